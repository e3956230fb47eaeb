"""The tail's per-leaf part with each repeated block's leaves through one shared compiled region
(:class:`BlockwiseTail`): the optimizer's graph stops growing with depth (``docs/design/step.md``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from d9dfn import optim
from d9dfn._types import OptState, Params, Transform
from d9dfn.parallel._grads import leaf_norms, shard_norms
from d9dfn.parallel._pipeline import PipelineReduction
from d9dfn.parallel._placement import is_distributed_tensor
from d9dfn.step._state_slots import StateSlots, flatten_state, is_slot_of, rebuilder
from d9dfn.step._tail_parts import TailUpdate, kept_leaf, kept_scalars, local_of, placed_like, total_norm

__all__ = ["BlockwiseTail"]


class BlockwiseTail:
    """The tail's per-leaf work with each repeated block's leaves through one shared region, built once per step.

    For the leaves outside the blocks, and for the scalars, it is the tail itself; for a block's leaves, two
    regions shared by the blocks with the same names inside the block (``self_attn.q_proj.weight``), so every
    block reuses the first block's compiled code: its scaled gradients' norms, then ``× 1/Σw`` (``× clip``) →
    ``optimizer.update`` on the block's part of the state → ``apply_updates`` → the skip. The maths and its order
    are the tail's, leaf by leaf, so results equal the whole-tree tail to rounding. Needs a ``leafwise`` optimizer
    (:class:`d9dfn.Transform`). ``DTensor`` leaves run through the regions as their local shards when the
    optimizer is ``elementwise``.

    Which names belong to which block, and the optimizer state's structure, are fixed outside the trace
    (:meth:`prepare`, before every call): dynamo traces every line of the tail at every start, and a region
    called with nothing but tensors and constants is matched to its first trace without flattening its inputs.
    """

    def __init__(self, modules: Sequence[nn.Module], blocks: Sequence[type[nn.Module]], optimizer: Transform) -> None:
        wanted = frozenset(blocks)
        self.prefixes = tuple(
            f"{name}." for model in modules for name, module in model.named_modules() if type(module) in wanted
        )
        self.optimizer = optimizer
        self._norms = torch.compiler.nested_compile_region(_scaled_norms)
        self._layout: _Layout | None = None

    def prepare(self, params: Params, opt_state: OptState) -> None:
        """Fix the layout for ``params`` and ``opt_state`` (kept while their names and structure stay the same)."""
        slot = is_slot_of(params.keys())
        leaves, spec = flatten_state(opt_state, slot)
        kinds = tuple(slot(leaf) for leaf in leaves)
        key = (tuple(params), spec, kinds)
        if self._layout is not None and self._layout.key == key:
            return
        groups, rest = _group_names(params, self.prefixes)
        rebuild = rebuilder(spec, len(leaves))
        regions: dict[tuple[str, ...], Callable[..., tuple[torch.Tensor, ...]]] = {}
        for group in groups:
            inner = tuple(group.values())
            if inner not in regions:
                regions[inner] = torch.compiler.nested_compile_region(
                    _block_update(self.optimizer, inner, rebuild, kinds)
                )
        blocks = tuple(_Block(tuple(group), regions[tuple(group.values())]) for group in groups)
        self._layout = _Layout(key, tuple(rest), blocks)

    @property
    def layout(self) -> _Layout:
        if self._layout is None:
            raise RuntimeError("BlockwiseTail: call prepare(params, opt_state) before the tail")
        return self._layout

    def __call__(
        self,
        params: Params,
        grads: Params,
        opt_state: OptState,
        inv_weight: torch.Tensor,
        loss: torch.Tensor,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
        pipeline: PipelineReduction | None,
        distributed: bool,
    ) -> TailUpdate:
        """``grads`` are the reduced sums ``Σwᵢ∇ℓᵢ``; the tail's steps from ``× 1/Σw`` to the skip. ``distributed``:
        whether some param is a ``DTensor``.

        The plumbing here is traced by dynamo line by line at every compile (and at every start, cache or not), so
        it is kept linear in the number of leaves and calls each region with its tensors as positional arguments
        (a region's tree arguments are flattened by a traced pytree at every call): the names were grouped by
        :meth:`prepare`, the optimizer state's per-param dicts are found once (:class:`StateSlots`), and the
        ``DTensor`` conversions run only when some param is one.
        """
        layout = self.layout
        rest = layout.rest
        rest_grads = {name: grads[name] * inv_weight.to(grads[name].dtype) for name in rest}
        norms = leaf_norms(rest_grads)
        # A DTensor's reduced gradients are views of one bucket (bucketed collectives): a region takes no two inputs
        # that share storage, so their local values are copied once (a gradient-sized copy, data parallelism only).
        local_grads = grads
        if distributed:
            local_grads = {
                name: local_of(grads[name]).clone() if is_distributed_tensor(grads[name]) else grads[name]
                for block in layout.blocks
                for name in block.names
            }
        for block in layout.blocks:  # a shard's local norm, then over the shards (shard_norms), as leaf_norms does
            local_norms = self._norms(inv_weight, *[local_grads[name] for name in block.names])
            block_norms = dict(zip(block.names, local_norms.unbind(), strict=True))
            norms.update(shard_norms(block_norms, grads) if distributed else block_norms)
        grad_norm = total_norm({name: norms[name] for name in params if name in norms}, pipeline)
        clip = optim.clip_factor(grad_norm, max_grad_norm) if max_grad_norm else None
        factor = (inv_weight,) if clip is None else (inv_weight, clip)
        nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        keep = nonfinite if skip_nonfinite else torch.zeros_like(nonfinite)

        state = StateSlots.of(opt_state, params.keys())
        rest_params, rest_state = {name: params[name] for name in rest}, state.restricted(rest)
        new_rest, rest_state_new = _update_leaves(
            self.optimizer, {name: grads[name] for name in rest}, rest_params, rest_state, factor
        )
        lr = optim.learning_rate(rest_state_new)  # what the update used, before a skip restores the state
        # The skip leaf by leaf over the flat state: one traced flatten of the new state, not a tree_map over both.
        new_state = StateSlots.of(rest_state_new, rest).like(state.slots, len(state.leaves), "the optimizer's update")
        new_params = {name: kept_leaf(keep, rest_params[name], new_rest[name]) for name in rest}
        slots = [
            {name: kept_leaf(keep, state.leaves[i][name], new_state.leaves[i][name]) for name in rest}
            for i in state.slots
        ]
        for block in layout.blocks:
            names = block.names
            # Without DTensors no per-leaf call at all: every traced call is paid again at every start.
            args = [*[local_grads[name] for name in names], *[params[name] for name in names]]
            for i, leaf in enumerate(state.leaves):
                if i in state.slots:
                    args.extend([leaf[name] for name in names])
                else:
                    args.append(leaf)
            if distributed:
                args = [local_of(arg) for arg in args]
            flat = block.update(keep, inv_weight, clip, *args)
            chunks = [flat[i : i + len(names)] for i in range(0, len(flat), len(names))]  # params, then each slot
            for into, chunk in zip([new_params, *slots], chunks, strict=True):
                if distributed:
                    into.update({name: placed_like(params[name], t) for name, t in zip(names, chunk, strict=True)})
                else:
                    into.update(zip(names, chunk, strict=True))
        ordered = iter([{name: slot[name] for name in params} for slot in slots])
        new_leaves = kept_scalars(
            keep, state, [next(ordered) if i in state.slots else leaf for i, leaf in enumerate(new_state.leaves)]
        )
        return TailUpdate(
            params={name: new_params[name] for name in params},
            opt_state=new_state.spec.unflatten(new_leaves),
            grad_norm=grad_norm,
            nonfinite=nonfinite,
            lr=lr,
        )


@dataclasses.dataclass(frozen=True)
class _Block:
    """One block's param names (full, in the block's order) and the update region for its inner names."""

    names: tuple[str, ...]
    update: Callable[..., tuple[torch.Tensor, ...]]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The params' names outside the blocks and in each block, for the params' names and the optimizer state's
    structure in ``key``."""

    key: tuple[Any, ...]
    rest: tuple[str, ...]
    blocks: tuple[_Block, ...]


def _block_update(
    optimizer: Transform, inner: tuple[str, ...], rebuild: Callable[[Sequence[Any]], Any], kinds: tuple[bool, ...]
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The update of one block's leaves, named ``inner``, from positional arguments only: the skip flag, ``1/Σw``,
    the clip factor (``None``: no clipping), the gradients, the params, then the optimizer state's leaves in tree
    order (a slot, ``kinds[i]``, as its tensors in ``inner``'s order), which ``rebuild`` makes the state again. Returns
    the new params, then each slot's new tensors, in ``inner``'s order."""
    n = len(inner)
    slots = tuple(i for i, slot in enumerate(kinds) if slot)

    def update(
        nonfinite: torch.Tensor, inv_weight: torch.Tensor, clip: torch.Tensor | None, *flat: Any
    ) -> tuple[torch.Tensor, ...]:
        grads, params = dict(zip(inner, flat[:n], strict=True)), dict(zip(inner, flat[n : 2 * n], strict=True))
        leaves: list[Any] = []
        at = 2 * n
        for slot in kinds:
            if slot:
                leaves.append(dict(zip(inner, flat[at : at + n], strict=True)))
                at += n
            else:
                leaves.append(flat[at])
                at += 1
        state = rebuild(leaves)
        factor = (inv_weight,) if clip is None else (inv_weight, clip)
        new_params, new_state = _update_leaves(optimizer, grads, params, state, factor)
        new = StateSlots.of(new_state, inner).like(slots, len(leaves), "the optimizer's update")
        out = [kept_leaf(nonfinite, params[name], new_params[name]) for name in inner]  # the skip, leaf by leaf
        for i in slots:
            out.extend(kept_leaf(nonfinite, leaves[i][name], new.leaves[i][name]) for name in inner)
        return tuple(out)

    return update


def _group_names(params: Params, prefixes: tuple[str, ...]) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The params' names by block (full name → name inside the block), in ``prefixes`` order, without the blocks
    this process does not hold; and the rest (name → itself). One pass over the names."""
    by_prefix: dict[str, dict[str, str]] = {prefix: {} for prefix in prefixes}
    rest: dict[str, str] = {}
    for name in params:
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            rest[name] = name
        else:
            by_prefix[prefix][name] = name[len(prefix) :]
    return [group for group in by_prefix.values() if group], rest


def _scaled_norms(inv_weight: torch.Tensor, *grads: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each ``g × 1/Σw`` in float32, stacked in ``grads``' order (``leaf_norms``' first half)."""
    scaled = [g * inv_weight.to(g.dtype) for g in grads]
    return torch.stack(list(torch._foreach_norm(scaled, 2.0, dtype=torch.float32)))


def _update_leaves(
    optimizer: Transform, grads: Params, params: Params, state: OptState, factor: tuple[torch.Tensor, ...]
) -> tuple[Params, OptState]:
    """``× 1/Σw`` (``× clip``) → ``optimizer.update`` → ``apply_updates``, as the whole-tree tail does them."""
    for f in factor:
        grads = {name: g * f.to(g.dtype) for name, g in grads.items()}
    updates, new_state = optimizer.update(grads, state, params)
    return optim.apply_updates(params, updates), new_state
