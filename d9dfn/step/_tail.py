"""The train step's tail, the same for every executor: the executor's :class:`~d9dfn.pipeline.ProgramResult` →
reduce over the data-parallel (and pipeline) group → ``× 1/Σw`` → global norm → clip → ``optimizer.update`` →
``apply_updates`` → the skip of a non-finite step → metrics.

The per-leaf part runs over the whole tree (:func:`update_whole`) or, with repeated blocks and a ``leafwise``
optimizer, each block's leaves through one shared compiled region (:class:`BlockwiseTail`: the optimizer's graph
stops growing with depth; ``docs/design/step.md``). Both take their norm from the same per-leaf norms
(``d9dfn.parallel.leaf_norms``), combined over the pipeline when there is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from d9dfn import optim
from d9dfn._numerics import safe_divide
from d9dfn._pipeline_state import PipelineState
from d9dfn._pytree import tree_map
from d9dfn._task import TrainTask
from d9dfn._types import GradientReduction, OptState, Params, Sums, Transform
from d9dfn.parallel._grads import leaf_norms, reduce_partial_gradients, shard_norms
from d9dfn.parallel._pipeline import PipelineReduction
from d9dfn.parallel._placement import is_distributed_tensor
from d9dfn.pipeline import ProgramResult
from d9dfn.step._microbatches import MicrobatchOut, weighted_logs
from d9dfn.step._precision import Precision
from d9dfn.step._state import StepOutput, TrainState
from d9dfn.step._state_slots import StateSlots, flatten_state, is_slot_of, rebuilder

__all__ = ["BlockwiseTail", "Tail", "TailUpdate", "kept", "update_whole"]


@dataclasses.dataclass(frozen=True)
class TailUpdate:
    """The tail's per-leaf part, done: params and optimizer state after the update (and the skip), and the
    step's gradient norm, non-finite flag and learning rate."""

    params: Params
    opt_state: OptState
    grad_norm: torch.Tensor
    nonfinite: torch.Tensor
    lr: torch.Tensor


def _total_norm(norms: Mapping[str, torch.Tensor], pipeline: PipelineReduction | None) -> torch.Tensor:
    """The global norm from per-leaf norms: over every stage with a pipeline (torchtitan#596 clipped with the
    local norm), else the norm of this process's norms (``optim.global_norm``'s formula)."""
    if pipeline is not None:
        return pipeline.total_norm(norms)
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(list(norms.values())))
    return total


def update_whole(
    train_state: TrainState,
    grad_sum: Params,
    inv_weight: torch.Tensor,
    loss: torch.Tensor,
    optimizer: Transform,
    max_grad_norm: float | None,
    skip_nonfinite: bool,
    pipeline: PipelineReduction | None,
) -> TailUpdate:
    """``× 1/Σw`` → global norm → clip → ``optimizer.update`` → ``apply_updates`` → skip, over the whole tree."""
    params = train_state.params
    grads = {name: g * inv_weight.to(g.dtype) for name, g in grad_sum.items()}
    grad_norm = _total_norm(leaf_norms(grads), pipeline)  # over all shards: one collective per sharding pattern
    if max_grad_norm:
        scale = optim.clip_factor(grad_norm, max_grad_norm)  # the norm over all shards, not this rank's
        grads = {name: g * scale.to(g.dtype) for name, g in grads.items()}
    updates, opt_state = optimizer.update(grads, train_state.opt_state, params)
    lr = optim.learning_rate(opt_state)  # what this update used, before a skip restores the state
    new_params = optim.apply_updates(params, updates)
    nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    if skip_nonfinite:
        new_params, opt_state = kept(nonfinite, (params, train_state.opt_state), (new_params, opt_state))
    return TailUpdate(params=new_params, opt_state=opt_state, grad_norm=grad_norm, nonfinite=nonfinite, lr=lr)


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
                name: _local(grads[name]).clone() if is_distributed_tensor(grads[name]) else grads[name]
                for block in layout.blocks
                for name in block.names
            }
        for block in layout.blocks:  # a shard's local norm, then over the shards (shard_norms), as leaf_norms does
            local_norms = self._norms(inv_weight, *[local_grads[name] for name in block.names])
            block_norms = dict(zip(block.names, local_norms.unbind(), strict=True))
            norms.update(shard_norms(block_norms, grads) if distributed else block_norms)
        grad_norm = _total_norm({name: norms[name] for name in params if name in norms}, pipeline)
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
        new_params = {name: _kept(keep, rest_params[name], new_rest[name]) for name in rest}
        slots = [
            {name: _kept(keep, state.leaves[i][name], new_state.leaves[i][name]) for name in rest} for i in state.slots
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
                args = [_local(arg) for arg in args]
            flat = block.update(keep, inv_weight, clip, *args)
            chunks = [flat[i : i + len(names)] for i in range(0, len(flat), len(names))]  # params, then each slot
            for into, chunk in zip([new_params, *slots], chunks, strict=True):
                if distributed:
                    into.update({name: _like(params[name], t) for name, t in zip(names, chunk, strict=True)})
                else:
                    into.update(zip(names, chunk, strict=True))
        ordered = iter([{name: slot[name] for name in params} for slot in slots])
        new_leaves = [
            next(ordered) if i in state.slots else _kept(keep, old, new)
            for i, (old, new) in enumerate(zip(state.leaves, new_state.leaves, strict=True))
        ]
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
        out = [_kept(nonfinite, params[name], new_params[name]) for name in inner]  # the skip, leaf by leaf
        for i in slots:
            out.extend(_kept(nonfinite, leaves[i][name], new.leaves[i][name]) for name in inner)
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


def _local(tensor: Any) -> Any:
    return tensor.to_local() if is_distributed_tensor(tensor) else tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` placed like ``param`` (a ``DTensor`` shard back into its ``DTensor``), else itself."""
    if not is_distributed_tensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


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


def kept(nonfinite: torch.Tensor, old: Any, new: Any) -> Any:
    """``new`` where the step is finite, ``old`` where it is not (tensor leaves; the rest is ``new``'s)."""
    return tree_map(lambda n, o: _kept(nonfinite, o, n), new, old)


def _kept(nonfinite: torch.Tensor, old: Any, new: Any) -> Any:
    """One leaf of :func:`kept`."""
    return torch.where(nonfinite, old, new) if isinstance(new, torch.Tensor) else new


class Tail:
    """Everything a training step does after its executor, for every executor (one stage, a pipeline program, or
    one pipeline rank's row); built once per step function.

    Args:
        task: its ``update_metrics`` folds the microbatches' states into the metric state.
        optimizer: the update.
        max_grad_norm: clip to this global norm (``None`` or 0: no clipping).
        skip_nonfinite: keep params, buffers, optimizer and metric state on a non-finite step.
        reduce_gradients: the data-parallel hook (sums over the group; ``None``: local sums).
        pipeline: on a pipeline rank, the ``pp`` reductions (``d9dfn.parallel.pipeline_reduction``).
        precision: gradients cross the data-parallel group in its ``reduce_dtype``.
        blockwise: the per-block form of the per-leaf part (:class:`BlockwiseTail`), or ``None``.
    """

    def __init__(
        self,
        task: TrainTask[Any],
        optimizer: Transform,
        *,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
        reduce_gradients: GradientReduction | None,
        pipeline: PipelineReduction | None,
        precision: Precision | None,
        blockwise: BlockwiseTail | None,
    ) -> None:
        self.task, self.optimizer = task, optimizer
        self.max_grad_norm, self.skip_nonfinite = max_grad_norm, skip_nonfinite
        self.reduce_gradients, self.pipeline, self.precision = reduce_gradients, pipeline, precision
        self.blockwise = blockwise
        self.local: frozenset[str] = frozenset()  # gradients that arrive as local shards (gathered per block)

    def prepare(self, train_state: TrainState) -> None:
        """Before every call, outside the trace: the per-block tail's layout for this state's names and structure."""
        if self.blockwise is not None:
            self.blockwise.prepare(train_state.params, train_state.opt_state)

    def reduce(self, sums: Sums, params: Params, distributed: bool) -> Sums:
        """The local sums → global ones: each ``DTensor`` param's partial gradient to its placement (in the
        policy's ``reduce_dtype``), then the data-parallel hook, then ``Σwℓ``/``Σw`` over the pipeline.
        ``distributed``: whether some param is a ``DTensor``."""
        grads, loss_sum, weight_sum = sums
        reduces = distributed or self.reduce_gradients is not None
        precision = self.precision if reduces else None
        if precision is not None:
            grads = precision.reduce(grads)
        if distributed:  # partial sums → each param's placement (all-reduce / reduce-scatter), few collectives
            grads = reduce_partial_gradients(grads, params, self.local)
        if self.reduce_gradients is not None:  # e.g. the data-parallel SUM: the 1/Σw below uses the global Σw
            grads, loss_sum, weight_sum = self.reduce_gradients(grads, loss_sum, weight_sum)
        if precision is not None:
            grads = precision.unreduce(grads, params)
        if self.pipeline is not None:  # then over pp: zeros from ranks without the last stage
            loss_sum, weight_sum = self.pipeline.sums(loss_sum, weight_sum)
        return Sums(grads, loss_sum, weight_sum)

    def __call__(
        self, train_state: TrainState, result: ProgramResult, distributed: bool
    ) -> tuple[TrainState, StepOutput]:
        """The new train state and the step's :class:`StepOutput` from the executor's ``result``. ``distributed``:
        whether some param is a ``DTensor``, decided by the caller outside the trace (a check of every param traced
        is paid again at every start)."""
        params = train_state.params
        outs: list[MicrobatchOut] = result.outs
        local_weight_sum = result.sums.weight  # the tasks' logs stay per-rank weighted means
        grads, loss_sum, weight_sum = self.reduce(result.sums, params, distributed)
        # ∇(Σwℓ/Σw) for every parameter (d9d skipped non-replicated ones: bug §11.2).
        inv_weight = safe_divide(torch.ones_like(weight_sum), weight_sum)
        loss = loss_sum * inv_weight
        per_leaf = (self.max_grad_norm, self.skip_nonfinite, self.pipeline)
        if self.blockwise is not None and self.blockwise.layout.rest:  # the rest carries the state's shared scalars
            done = self.blockwise(params, grads, train_state.opt_state, inv_weight, loss, *per_leaf, distributed)
        else:
            done = update_whole(train_state, grads, inv_weight, loss, self.optimizer, *per_leaf)
        buffers = result.buffers
        if self.skip_nonfinite:
            buffers = kept(done.nonfinite, train_state.buffers, buffers)
        metric_state = train_state.metric_state
        if metric_state is not None and outs:  # no metric state, no metrics (init_train_state(task=...) creates it)
            metric_state = self.task.update_metrics(metric_state, PipelineState.merge([out.state for out in outs]))
            if self.skip_nonfinite:  # a skipped step leaves no trace, in the metrics either
                metric_state = kept(done.nonfinite, train_state.metric_state, metric_state)
        new_state = train_state.replace(
            params=done.params,
            buffers=buffers,
            opt_state=done.opt_state,
            step=train_state.step + 1,
            metric_state=metric_state,
        )
        output = StepOutput(
            loss=loss,
            loss_weight=weight_sum,
            grad_norm=done.grad_norm,
            lr=done.lr.to(loss.device),
            nonfinite=done.nonfinite,
            skipped=done.nonfinite & self.skip_nonfinite,
            logs=weighted_logs(outs, local_weight_sum),
        )
        return new_state, output
