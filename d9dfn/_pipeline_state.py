"""PipelineState: an immutable mapping that carries data between a task's phases, per key with a spec.

d9d's PipelineState is mutable and lazy: it guesses a spec from the first value written to a key, keeps
that guess across steps (a 0-d tensor in step 1 makes a 1-D tensor in step 2 stack instead of
concatenate), and replicates whole dicts. d9dfn's is a value: every write returns a new state, the spec
is computed from the value at that write (or given), and :meth:`PipelineState.split` /
:meth:`PipelineState.merge` are explicit. See ``docs/design/pipeline-state.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

from d9dfn._pytree import NAMESPACE, tree_leaves, tree_map, tree_map_with_path, tree_structure
from d9dfn._sharding import (
    SpecShard,
    _shard,
    _unshard,
    check_spec,
    normalize_spec,
    spec_on_dim,
)
from d9dfn._types import KeyPath, PyTree

__all__ = ["PipelineState"]


def microbatch_spec(value: PyTree) -> PyTree:
    """The default spec of a per-microbatch write: how the microbatches' values join in :meth:`PipelineState.merge`.

    >>> microbatch_spec({"loss": torch.tensor(1.0), "ids": torch.ones(2), "tags": ["a"], "name": "x"})
    {'loss': SpecShard(0, stack=True), 'ids': SpecShard(0), 'tags': SpecShard(0), 'name': SpecShard(0, stack=True)}
    """

    def leaf_spec(_path: KeyPath, x: Any) -> SpecShard:
        if isinstance(x, list) or (isinstance(x, torch.Tensor) and x.ndim > 0):
            return SpecShard(0)
        return SpecShard(0, stack=True)

    return tree_map_with_path(leaf_spec, value, is_leaf=lambda x: isinstance(x, (torch.Tensor, list)))


class _SpecKey:
    """A spec tree made hashable and comparable by value, so it can ride in a treespec's aux data."""

    __slots__ = ("_key", "spec")

    def __init__(self, spec: PyTree) -> None:
        self.spec = spec
        self._key = (tree_structure(spec), tuple(tree_leaves(spec)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SpecKey) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return repr(self.spec)


class PipelineState(Mapping[str, Any]):
    """An immutable mapping ``str -> pytree`` with a spec per key and a view (global or one microbatch's).

    Every write returns a new state; nothing is ever changed in place. A *global* state holds values for
    the whole local batch (what ``build_forward_inputs`` and ``update_metrics`` see); :meth:`split` makes
    one *microbatch* state per microbatch (what ``compute_loss`` sees) and :meth:`merge` joins them back.
    Each key's spec says how its value splits and joins.

    **Default specs** (``spec=None`` in :meth:`set`) are computed from *this* value at *this* write; an
    earlier write to the key never matters (d9d remembers its first guess across steps).

    * A write to a **global** state: ``spec_on_dim(value, 0)``, leaf by leaf. Tensors with at least one dim
      and lists split on dim 0 (evenly, unless ``split(..., even=False)``); 0-d tensors and other leaves
      (numbers, strings, ``None``) are replicated, the same object in every microbatch. Dicts, tuples and
      d9dfn dataclasses are recursed into, so a dict of tensors splits too (d9d replicates whole dicts).
    * A write to a **microbatch** state says how the microbatches' values merge:

      =====================  =============================  ===========================================
      leaf                   spec                           merged global value
      =====================  =============================  ===========================================
      0-d tensor             ``SpecShard(0, stack=True)``   a 1-D tensor ``[num_microbatches]``
      tensor, ndim >= 1      ``SpecShard(0)``               concatenated on dim 0 (sizes may differ)
      list                   ``SpecShard(0)``               the lists concatenated
      anything else          ``SpecShard(0, stack=True)``   a list with one object per microbatch
      =====================  =============================  ===========================================

      Dicts, tuples and dataclasses are recursed into the same way.

    Pass a spec to choose otherwise, e.g. ``SpecShard(0, stack=True)`` for a whole dict per microbatch,
    or ``SpecReplicate()`` for a global value every microbatch should see whole.

    **Merge.** All states must be microbatch views of one split, with the same keys and specs. Values that
    were not written since :meth:`split` still carry the spec they were split with, so
    ``merge(split(s))`` equals ``s``.

    **Values are data.** Tensors are detached on write (``set(..., detach=False)`` keeps the graph): the
    state passes metrics and outputs between phases; the loss, which needs its graph, leaves through
    ``compute_loss``'s return value.

    The state is a pytree (optree namespace ``d9dfn`` and ``torch.utils._pytree``): the children are the
    values in key order, the keys, specs and view are static, so it flows through ``torch.func`` and
    ``torch.compile``.

    >>> s = PipelineState().set("ids", torch.arange(4)).set("temperature", torch.tensor(0.5))
    >>> a, b = s.split(2)
    >>> a["ids"], a["temperature"]
    (tensor([0, 1]), tensor(0.5000))
    >>> a, b = a.set("loss", torch.tensor(1.0)), b.set("loss", torch.tensor(3.0))
    >>> PipelineState.merge([a, b])["loss"]
    tensor([1., 3.])
    """

    __slots__ = ("_num_microbatches", "_specs", "_values")

    _values: dict[str, PyTree]
    _specs: dict[str, PyTree]
    _num_microbatches: int | None

    def __init__(self) -> None:
        """An empty global state; fill it with :meth:`set` or build one with :meth:`from_dict`."""
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_specs", {})
        object.__setattr__(self, "_num_microbatches", None)

    @classmethod
    def _make(cls, values: dict[str, PyTree], specs: dict[str, PyTree], num_microbatches: int | None) -> PipelineState:
        state = cls.__new__(cls)
        object.__setattr__(state, "_values", values)
        object.__setattr__(state, "_specs", specs)
        object.__setattr__(state, "_num_microbatches", num_microbatches)
        return state

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"PipelineState is immutable: cannot set {name!r}; use state.set(key, value), which returns a new state"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"PipelineState is immutable: cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        # copy, deepcopy and pickle rebuild through _make, since attribute assignment is blocked.
        return (PipelineState._make, (self._values, self._specs, self._num_microbatches))

    @classmethod
    def from_dict(cls, values: Mapping[str, PyTree], specs: Mapping[str, PyTree] | None = None) -> PipelineState:
        """A global state holding ``values``; ``specs`` gives some keys' specs (the rest get the default).

        >>> PipelineState.from_dict({"x": torch.ones(2)}).spec("x")
        SpecShard(0)
        """
        if not isinstance(values, Mapping):
            raise TypeError(
                f"PipelineState.from_dict: values must be a mapping of str keys, got {type(values).__name__}"
            )
        specs = dict(specs or {})
        unknown = [key for key in specs if key not in values]
        if unknown:
            raise ValueError(
                f"PipelineState.from_dict: specs given for keys {unknown} that have no value (keys: {list(values)}); "
                "give a value for each spec or drop the spec"
            )
        state = cls()
        for key, value in values.items():
            state = state.set(key, value, spec=specs.get(key))
        return state

    # --- the view -----------------------------------------------------------------------------------

    @property
    def num_microbatches(self) -> int | None:
        """How many microbatches this state is one of; ``None`` for the global view.

        The view does not hold the microbatch's index: a compiled per-microbatch function would then see a
        new static value, and recompile, for every microbatch. :meth:`merge` takes the states in order.
        """
        return self._num_microbatches

    @property
    def is_global(self) -> bool:
        """Whether this is the global view (the whole local batch)."""
        return self._num_microbatches is None

    # --- reading ------------------------------------------------------------------------------------

    def _check_key(self, fn: str, key: object) -> None:
        if not isinstance(key, str):
            raise TypeError(f"PipelineState.{fn}: keys are str, got {key!r} of type {type(key).__name__}")

    def __getitem__(self, key: str) -> PyTree:
        self._check_key("__getitem__", key)
        if key not in self._values:
            raise KeyError(
                f"PipelineState has no key {key!r}; present keys: {list(self._values)}. "
                "Set it with state.set(key, value) in an earlier phase"
            )
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    # Mapping's value equality would compare tensors elementwise; a state compares by identity.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        view = "global" if self.is_global else f"microbatch of {self._num_microbatches}"
        items = ", ".join(f"{key!r}: {_summary(value)} @ {self._specs[key]!r}" for key, value in self._values.items())
        return f"PipelineState({view}; {{{items}}})"

    def spec(self, key: str) -> PyTree:
        """The spec stored with ``key``'s value (``None`` leaves already made :class:`SpecReplicate`)."""
        self[key]  # raises a KeyError that lists the present keys
        return self._specs[key]

    # --- writing ------------------------------------------------------------------------------------

    def set(self, key: str, value: PyTree, spec: PyTree = None, *, detach: bool = True) -> PipelineState:
        """A new state with ``key`` holding ``value``; this state is unchanged.

        Args:
            key: a string.
            value: any pytree.
            spec: how the value splits (global view) or merges (microbatch view); ``None`` computes the
                default from this value (see the class docstring). A spec may be a prefix of the value.
            detach: detach tensors (the default); pass False to keep their autograd graph.

        Raises:
            TypeError: ``key`` is not a str, or the spec cannot apply to the value's leaf types.
            ValueError: the spec's structure does not fit the value, or a dim is out of range.
        """
        self._check_key("set", key)
        if detach:
            value = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)
        if spec is None:
            spec = spec_on_dim(value, 0) if self.is_global else microbatch_spec(value)
        else:
            check_spec("PipelineState.set", value, spec, mergeable=not self.is_global, prefix=(key,))
            spec = normalize_spec(spec)
        return PipelineState._make({**self._values, key: value}, {**self._specs, key: spec}, self._num_microbatches)

    # --- split and merge ----------------------------------------------------------------------------

    def split(self, num_microbatches: int, *, even: bool = True) -> tuple[PipelineState, ...]:
        """Split a global state into ``num_microbatches`` microbatch states, each key by its spec.

        Args:
            num_microbatches: how many microbatches.
            even: raise unless every split size divides by ``num_microbatches`` (the default, as for a
                pipeline's microbatches); with False, split like ``torch.tensor_split``.

        Raises:
            ValueError: this is a microbatch state, or a value cannot split (the message names the key path).
        """
        fn = "PipelineState.split"
        if not self.is_global:
            raise ValueError(
                f"{fn}: this state is already one of {self._num_microbatches} microbatches; split a global state "
                "(merge the microbatch states first)"
            )
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
            raise TypeError(f"{fn}: num_microbatches must be an int, got {num_microbatches!r}")
        if num_microbatches < 1:
            raise ValueError(f"{fn}: num_microbatches must be at least 1, got {num_microbatches}")
        per_key = {
            key: _shard(fn, value, self._specs[key], num_microbatches, even=even, prefix=(key,), unit="microbatch")
            for key, value in self._values.items()
        }
        return tuple(
            PipelineState._make({key: pieces[i] for key, pieces in per_key.items()}, self._specs, num_microbatches)
            for i in range(num_microbatches)
        )

    @staticmethod
    def merge(states: Sequence[PipelineState], *, check_replicated: bool = False) -> PipelineState:
        """Join the microbatch states of one split into a global state, each key by its spec.

        Args:
            states: all the microbatch states, in microbatch order.
            check_replicated: verify that replicated values agree across microbatches (see ``unshard_tree``).

        Raises:
            TypeError: an item is not a PipelineState.
            ValueError: no states, a global state among them, a count that does not match their view, or a
                key that is missing in, or was written with another spec by, some microbatch.
        """
        fn = "PipelineState.merge"
        states = tuple(states)
        if not states:
            raise ValueError(f"{fn}: got no states; pass the microbatch states that split() returned")
        for index, state in enumerate(states):
            if not isinstance(state, PipelineState):
                raise TypeError(f"{fn}: item {index} is a {type(state).__name__}, not a PipelineState")
            if state.is_global:
                raise ValueError(f"{fn}: state {index} is a global state; merge takes the microbatch states of a split")
            if state.num_microbatches != len(states):
                raise ValueError(
                    f"{fn}: state {index} is one of {state.num_microbatches} microbatches, but {len(states)} states "
                    "were given; pass all the microbatch states of one split, in order"
                )
        first = states[0]
        for index, state in enumerate(states[1:], start=1):
            missing = [key for key in first if key not in state]
            extra = [key for key in state if key not in first]
            if missing or extra:
                key, where, absent = (missing[0], 0, index) if missing else (extra[0], index, 0)
                raise ValueError(
                    f"{fn}: key {key!r} is set in microbatch {where} but missing in microbatch {absent}; "
                    "every microbatch must set the same keys"
                )
            for key in first:
                if state._specs[key] != first._specs[key]:
                    raise ValueError(
                        f"{fn}: key {key!r} has spec {first._specs[key]!r} in microbatch 0 but "
                        f"{state._specs[key]!r} in microbatch {index}; write it with the same value types and "
                        "shapes (or one explicit spec) in every microbatch"
                    )
        values = {
            key: _unshard(
                fn,
                [state._values[key] for state in states],
                first._specs[key],
                check_replicated=check_replicated,
                prefix=(key,),
                unit="microbatch",
            )
            for key in first
        }
        return PipelineState._make(values, dict(first._specs), None)


def _summary(value: PyTree) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return type(value).__name__


def _flatten(state: PipelineState) -> tuple[tuple[PyTree, ...], tuple[Any, ...], tuple[str, ...]]:
    keys = tuple(state._values)
    aux = (keys, tuple(_SpecKey(state._specs[key]) for key in keys), state._num_microbatches)
    return tuple(state._values[key] for key in keys), aux, keys


def _unflatten(aux: tuple[Any, ...], children: Iterable[PyTree]) -> PipelineState:
    keys, spec_keys, num_microbatches = aux
    values = dict(zip(keys, children, strict=True))
    specs = {key: spec_key.spec for key, spec_key in zip(keys, spec_keys, strict=True)}
    return PipelineState._make(values, specs, num_microbatches)


def _torch_flatten(state: PipelineState) -> tuple[list[PyTree], tuple[Any, ...]]:
    children, aux, _ = _flatten(state)
    return list(children), aux


def _torch_flatten_with_keys(state: PipelineState) -> tuple[list[tuple[Any, PyTree]], tuple[Any, ...]]:
    children, aux, keys = _flatten(state)
    return [(torch_pytree.MappingKey(key), child) for key, child in zip(keys, children, strict=True)], aux


# optree's stubs want flatten/unflatten over any Collection, not over the one class they register.
optree.register_pytree_node(
    PipelineState,
    _flatten,  # type: ignore[arg-type]
    _unflatten,  # type: ignore[arg-type]
    path_entry_type=optree.MappingEntry,
    namespace=NAMESPACE,
)
torch_pytree.register_pytree_node(
    PipelineState,
    _torch_flatten,
    lambda children, aux: _unflatten(aux, children),
    serialized_type_name=f"{PipelineState.__module__}.PipelineState",
    flatten_with_keys_fn=_torch_flatten_with_keys,
)
