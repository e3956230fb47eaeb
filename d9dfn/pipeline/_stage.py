"""Pipeline stages as pure functions over a slice of the model that keeps full parameter names.

A :class:`Stage` is a meta sub-skeleton of the model (only that stage's submodules, named as in the whole
model: ``layers.2.mlp.up_proj.weight`` stays ``layers.2.mlp.up_proj.weight``) and a pure call
``stage(params, buffers, inputs, kwargs) -> (outputs, new_buffers)``. The dataflow is d9d's: stage 0 gets
the task's ``inputs``, stage ``i + 1`` gets stage ``i``'s output dict as its ``inputs`` (by name), and every
stage gets the same ``kwargs`` (d9d's stage calls ``module(**inputs, **kwargs)``:
``d9d/pipelining/infra/stage/computations.py`` in github.com/d9d-project/d9d).

Stages come from a model that builds any stage (:func:`build_stages`, d9d's contract: ``Qwen3LM(config,
stage=PipelineStageInfo(i, n))``) or from a per-stage list of names (:func:`split_stages`, torchtitan's
``module_fqns_per_model_part``). :func:`stage_io_shapes` runs the stages on meta tensors to find the
boundary shapes, so ranks never exchange shapes at run time.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from d9dfn._pytree import tree_map
from d9dfn._types import Buffers, Params, PipelineStageInfo

__all__ = ["Stage", "build_stages", "distribute_layers", "split_stages", "stage_io_shapes"]


def distribute_layers(
    num_layers: int, num_stages: int, *, first_stage_cost: int = 0, last_stage_cost: int = 0
) -> tuple[range, ...]:
    """Each stage's range of layer indices: d9d's ``distribute_layers_for_pipeline_stage``, all stages at once.

    The ``num_layers + first_stage_cost + last_stage_cost`` "virtual" layers are split evenly, the first
    ``remainder`` stages taking one more; then the first stage gives up ``first_stage_cost`` of its share (for
    the embedding) and the last ``last_stage_cost`` (for the head and the loss). The results equal d9d's.

    Args:
        num_layers: how many layers (decoder blocks) to place.
        num_stages: how many pipeline stages.
        first_stage_cost: virtual layers standing for the first stage's extra work.
        last_stage_cost: virtual layers standing for the last stage's extra work.

    Returns:
        ``num_stages`` contiguous, non-empty ranges that tile ``range(num_layers)`` in order.

    Raises:
        ValueError: a count is negative, or some stage would get no layer.

    >>> distribute_layers(24, 4, first_stage_cost=1, last_stage_cost=1)
    (range(0, 6), range(6, 13), range(13, 19), range(19, 24))
    >>> distribute_layers(34, 4)
    (range(0, 9), range(9, 18), range(18, 26), range(26, 34))
    """
    for name, value, low in (
        ("num_layers", num_layers, 0),
        ("num_stages", num_stages, 1),
        ("first_stage_cost", first_stage_cost, 0),
        ("last_stage_cost", last_stage_cost, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"distribute_layers: {name}={value!r} must be an int >= {low}")
    num_virtual = num_layers + first_stage_cost + last_stage_cost
    base, extra = divmod(num_virtual, num_stages)
    counts = [base + (index < extra) for index in range(num_stages)]
    counts[0] -= first_stage_cost
    counts[-1] -= last_stage_cost
    if min(counts) <= 0:
        empty = next(index for index, count in enumerate(counts) if count <= 0)
        raise ValueError(
            f"distribute_layers: {num_layers} layers over {num_stages} stages with first_stage_cost="
            f"{first_stage_cost} and last_stage_cost={last_stage_cost} leave stage {empty} with {counts[empty]} "
            f"layers (counts {counts}); use fewer stages, more layers, or lower the stage costs"
        )
    bounds = (0, *itertools.accumulate(counts))
    return tuple(range(start, stop) for start, stop in itertools.pairwise(bounds))


def _select(owner: str, tree: Mapping[str, Any], names: frozenset[str], what: str) -> dict[str, Any]:
    missing = sorted(names - tree.keys())
    if missing:
        raise ValueError(
            f"{owner}: {what} lacks {missing[0]!r} ({len(missing)} of this stage's {len(names)} missing); "
            f"pass the whole model's {what} (e.g. train_state.{what}) or this stage's"
        )
    return {name: value for name, value in tree.items() if name in names}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: a meta sub-skeleton with full parameter names, called as a pure function.

    Build it with :meth:`from_module`, :func:`build_stages` or :func:`split_stages`.

    Attributes:
        index: the stage's position in the pipeline (0 takes the task's ``inputs``).
        param_names: the full names of the parameters this stage owns.
        buffer_names: the full names of its buffers (all treated as mutable, as ``make_train_step`` does).
        module: the skeleton; its own tensors are never read by :meth:`__call__` (usually on ``meta``).

    >>> with torch.device("meta"):
    ...     stage = Stage.from_module(0, nn.Sequential(nn.Linear(2, 3)))
    >>> sorted(stage.param_names)
    ['0.bias', '0.weight']
    """

    index: int
    param_names: frozenset[str]
    buffer_names: frozenset[str]
    module: nn.Module

    def __post_init__(self) -> None:
        params = frozenset(name for name, _ in self.module.named_parameters())
        buffers = frozenset(name for name, _ in self.module.named_buffers())
        if params != self.param_names or buffers != self.buffer_names:
            raise ValueError(
                f"Stage {self.index}: param_names/buffer_names differ from the module's "
                f"({sorted(params ^ self.param_names)[:3]} / {sorted(buffers ^ self.buffer_names)[:3]}); "
                "build the stage with Stage.from_module(index, module)"
            )

    @classmethod
    def from_module(cls, index: int, module: nn.Module) -> Stage:
        """The stage ``index`` whose skeleton is ``module`` (names taken from it as they are)."""
        params = frozenset(name for name, _ in module.named_parameters())
        buffers = frozenset(name for name, _ in module.named_buffers())
        return cls(index=index, param_names=params, buffer_names=buffers, module=module)

    def select_params(self, params: Mapping[str, Any]) -> Params:
        """This stage's entries of ``params`` (e.g. ``train_state.params``), in ``params``' order."""
        return _select(f"Stage {self.index}.select_params", params, self.param_names, "params")

    def select_buffers(self, buffers: Mapping[str, Any]) -> Buffers:
        """This stage's entries of ``buffers`` (e.g. ``train_state.buffers``), in ``buffers``' order."""
        return _select(f"Stage {self.index}.select_buffers", buffers, self.buffer_names, "buffers")

    def __call__(
        self, params: Params, buffers: Buffers, inputs: Mapping[str, Any], kwargs: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Buffers]:
        """``module(**inputs, **kwargs)`` on the given tensors; returns the named outputs and the new buffers.

        Pure: buffers are cloned before the call (BatchNorm updates its statistics in place), so nothing
        passed in is written. ``None`` outputs are dropped (d9d's contract).

        Args:
            params: exactly this stage's params (:meth:`select_params` cuts them from the whole model's).
            buffers: exactly this stage's buffers.
            inputs: the task's ``inputs`` on stage 0; the previous stage's outputs on the others.
            kwargs: the microbatch's kwargs, the same for every stage.

        Raises:
            ValueError: ``params`` or ``buffers`` do not hold exactly this stage's names, or an input name is
                also a kwarg.
            TypeError: the module returned something other than a dict of named outputs.
        """
        for what, given, names in (("params", params, self.param_names), ("buffers", buffers, self.buffer_names)):
            if given.keys() != names:
                missing, extra = sorted(names - given.keys()), sorted(given.keys() - names)
                raise ValueError(
                    f"Stage {self.index}: {what} has {len(extra)} names of other stages (first: {extra[:1]}) and "
                    f"misses {len(missing)} of its own (first: {missing[:1]}); pass stage.select_{what}({what})"
                )
        clash = sorted(inputs.keys() & kwargs.keys())
        if clash:
            raise ValueError(
                f"Stage {self.index}: {clash[0]!r} is both an input and a kwarg; rename one of them (stage "
                "outputs become the next stage's inputs by name)"
            )
        buffers = {name: t.clone() for name, t in buffers.items()}
        outputs = functional_call(self.module, (params, buffers), args=(), kwargs={**inputs, **kwargs}, strict=True)
        if not isinstance(outputs, Mapping):
            raise TypeError(
                f"Stage {self.index}: {type(self.module).__name__}.forward returned {type(outputs).__name__}; a "
                "stage returns a dict of named outputs, e.g. {'hidden_states': h}, whose names are the next "
                "stage's input names"
            )
        return {name: value for name, value in outputs.items() if value is not None}, buffers


def build_stages(build: Callable[[PipelineStageInfo], nn.Module], num_stages: int) -> tuple[Stage, ...]:
    """Every stage of a model that builds its own slice (d9d's contract), each on the meta device.

    Args:
        build: makes the module of one stage, e.g. ``lambda info: Qwen3LM(config, stage=info)``.
        num_stages: how many stages.

    Returns:
        ``num_stages`` stages.

    Raises:
        ValueError: two stages hold a parameter or buffer of the same name.

    >>> stages = build_stages(lambda info: nn.ModuleDict({str(info.current_stage): nn.Linear(2, 2)}), 2)
    >>> [sorted(s.param_names) for s in stages]
    [['0.bias', '0.weight'], ['1.bias', '1.weight']]
    """
    stages = []
    for index in range(num_stages):
        with torch.device("meta"):
            module = build(PipelineStageInfo(current_stage=index, num_stages=num_stages))
        stages.append(Stage.from_module(index, module))
    _check_disjoint("build_stages", stages, "build each name on exactly one stage")
    return tuple(stages)


def _check_disjoint(owner: str, stages: Sequence[Stage], fix: str) -> None:
    owners: dict[str, int] = {}
    for stage in stages:
        for name in sorted(stage.param_names | stage.buffer_names):
            if name in owners:
                raise ValueError(f"{owner}: {name!r} is on stage {owners[name]} and on stage {stage.index}; {fix}")
            owners[name] = stage.index


def _meta_copy(model: nn.Module) -> nn.Module:
    # deepcopy with every tensor pre-mapped to a meta twin: no real memory, and tied tensors stay tied.
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        twin = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            twin = nn.Parameter(twin, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = twin
    return copy.deepcopy(model, memo)


_CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.Sequential)


def _prune(module: nn.Module, prefix: str, keep: frozenset[str]) -> None:
    """Delete what is neither named in ``keep`` nor on the way to a name in it."""

    def wanted(name: str) -> bool:
        return name in keep or any(k.startswith(name + ".") for k in keep)

    for name in list(module._modules):
        full = prefix + name
        child = module._modules[name]
        if full in keep or child is None:
            continue
        if wanted(full):
            _prune(child, full + ".", keep)
        elif isinstance(module, _CONTAINERS):
            # Remove the key only: Sequential and ModuleList iterate _modules, and the names of the rest
            # stay as they were (never rebuild a ModuleList, which would renumber).
            del module._modules[name]
        else:
            module._modules[name] = None  # torchtitan's convention: forward checks `if self.norm is not None`
    for table in (module._parameters, module._buffers):
        for name in list(table):
            if prefix + name not in keep:
                table[name] = None


def split_stages(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]]) -> tuple[Stage, ...]:
    """Cut ``model`` into stages by name: torchtitan's ``module_fqns_per_model_part``, keeping full names.

    Stage ``i`` is a meta copy of ``model`` in which only the submodules (or single parameters/buffers) named
    in ``fqns_per_stage[i]`` remain, with their ancestors. Children of ``ModuleDict``/``ModuleList``/
    ``Sequential`` are removed, other submodules set to ``None``, so the model's ``forward`` must skip what is
    absent (``nn.Sequential`` does). A model that cannot be cut this way builds its own stages
    (:func:`build_stages`).

    Args:
        model: the whole model (any device; its tensors are not copied).
        fqns_per_stage: per stage, the names of the modules (or params/buffers) it holds.

    Returns:
        One :class:`Stage` per entry, whose names partition the model's.

    Raises:
        ValueError: a name is not in the model, or a parameter/buffer is on no stage or on two.

    >>> net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> [sorted(s.param_names) for s in split_stages(net, [["0", "1"], ["2"]])]
    [['0.bias', '0.weight'], ['2.bias', '2.weight']]
    """
    known = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    known |= {name for name, _ in model.named_buffers()}
    for index, fqns in enumerate(fqns_per_stage):
        if isinstance(fqns, str):
            raise ValueError(f"split_stages: stage {index} is the string {fqns!r}; pass a list of names: [{fqns!r}]")
        for fqn in fqns:
            if fqn not in known or fqn == "":
                near = sorted(n for n in known if n and n.split(".")[0] == fqn.split(".")[0])[:5]
                raise ValueError(
                    f"split_stages: stage {index} names {fqn!r}, which is not a submodule, parameter or buffer of "
                    f"{type(model).__name__}; names that start alike: {near or 'none'}"
                )
    stages = []
    for index, fqns in enumerate(fqns_per_stage):
        module = _meta_copy(model)
        _prune(module, "", frozenset(fqns))
        stages.append(Stage.from_module(index, module))
    fix = "list every module in exactly one stage"
    _check_disjoint("split_stages", stages, fix)
    _check_untied_across_stages(model, stages)
    held = set().union(*(s.param_names | s.buffer_names for s in stages))
    orphans = [n for n, _ in (*model.named_parameters(), *model.named_buffers()) if n not in held]
    if orphans:
        raise ValueError(f"split_stages: {orphans[0]!r} is on no stage ({len(orphans)} names in all); {fix}")
    return tuple(stages)


def _check_untied_across_stages(model: nn.Module, stages: Sequence[Stage]) -> None:
    """Refuse a tensor that two stages hold under different names (tied weights, e.g. embedding and LM head).

    Each stage's gradient would miss the other's contribution and the two copies would drift apart; summing them
    over the two owners (Megatron's embedding group) is not implemented.
    """
    aliases: dict[int, list[str]] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        aliases.setdefault(id(tensor), []).append(name)
    for names in aliases.values():
        holders = sorted({s.index for s in stages for n in names if n in s.param_names | s.buffer_names})
        if len(names) > 1 and len(holders) > 1:
            raise ValueError(
                f"split_stages: {names[0]!r} is tied to {names[1:]} and the names are on stages {holders}; a weight "
                "tied across stages is not supported: untie it (e.g. tie_word_embeddings=False) or put every module "
                "that uses it on one stage"
            )


def _meta_like(value: Any, rows: int | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    shape = (rows, *value.shape[1:]) if rows is not None and value.ndim > 0 else value.shape
    return torch.empty(shape, dtype=value.dtype, device="meta")


def stage_io_shapes(
    stages: Sequence[Stage],
    inputs: Mapping[str, Any],
    kwargs: Mapping[str, Any],
    microbatch_size: int,
    call: Callable[..., tuple[dict[str, Any], Any]] | None = None,
) -> tuple[dict[str, torch.Tensor], ...]:
    """Each stage's outputs for one microbatch, as meta tensors: the boundary shapes and dtypes.

    Runs every stage on its own meta skeleton (no real memory, no shape exchange between ranks). Tensors of
    ``inputs`` and ``kwargs`` with a dim are cut to ``microbatch_size`` rows on dim 0, as the step's default
    split (``spec_on_dim(..., 0)``) does; 0-d tensors and other values pass as they are.

    Args:
        stages: all stages in order (every rank can build every skeleton on ``meta``).
        inputs: the task's ``inputs`` for the local batch (real or meta tensors).
        kwargs: the task's ``kwargs`` for the local batch, plus per-microbatch keys such as ``dropout_key``
            (0-d, so passed as they are).
        microbatch_size: rows per microbatch; must divide every cut tensor's dim 0.
        call: ``call(stage, params, buffers, inputs, kwargs) -> (outputs, buffers)``, how the step calls a stage
            (e.g. cast to a compute dtype first, so the boundary dtypes are the ones sent); default ``Stage.__call__``.

    Returns:
        Per stage, its output dict with meta tensors; allocate receive buffers with
        ``torch.empty_like(spec, device=device)``.

    Raises:
        ValueError: ``microbatch_size`` does not divide a tensor's dim 0.

    >>> class Net(nn.Sequential):  # d9d's contract: named outputs are the next stage's inputs
    ...     def forward(self, x):
    ...         return {"x": super().forward(x)}
    >>> stages = split_stages(Net(nn.Linear(4, 8), nn.Linear(8, 3)), [["0"], ["1"]])
    >>> [tuple(out["x"].shape) for out in stage_io_shapes(stages, {"x": torch.zeros(8, 4)}, {}, microbatch_size=2)]
    [(2, 8), (2, 3)]
    """
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"stage_io_shapes: microbatch_size={microbatch_size!r}; pass a positive int")
    for where, tree in (("inputs", inputs), ("kwargs", kwargs)):
        for name, value in tree.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] % microbatch_size:
                raise ValueError(
                    f"stage_io_shapes: {where}[{name!r}] has {value.shape[0]} rows, which microbatch_size="
                    f"{microbatch_size} does not divide; pass a divisor of the local batch size"
                )
    meta_inputs = tree_map(lambda x: _meta_like(x, microbatch_size), dict(inputs))
    meta_kwargs = tree_map(lambda x: _meta_like(x, microbatch_size), dict(kwargs))
    shapes = []
    with torch.no_grad():
        for stage in stages:
            params = {name: _meta_like(t, None) for name, t in stage.module.named_parameters()}
            buffers = {name: _meta_like(t, None) for name, t in stage.module.named_buffers()}
            outputs, _ = (call or Stage.__call__)(stage, params, buffers, meta_inputs, meta_kwargs)
            outputs = tree_map(lambda x: _meta_like(x, None), outputs)
            shapes.append(outputs)
            meta_inputs = outputs
    return tuple(shapes)
