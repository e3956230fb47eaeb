"""The reference executor: a :class:`~d9dfn.pipeline.Program` interpreted with every stage in one process.

It is the oracle a multi-rank executor is checked against, and what ``make_train_step(pipeline=...)`` runs. Per
action (``docs/design/pipeline.md``, "Executors"):

- ``F`` runs the stage's pure function under ``torch.func.vjp`` and keeps the backward closure; on the last stage
  it also runs the caller's ``loss(outputs, state) -> (w·ℓ, aux)``.
- ``B`` calls the closure with the output gradients (``1`` for the last stage's ``w·ℓ``), adds the weight
  gradients into ``Σw∇ℓ`` and hands the input gradients to the previous stage.
- ``I`` is ``B`` with the weight gradients held back; ``W`` adds them. This is the I/W *order* of a zero-bubble
  schedule, not its saving: ``vjp`` computes both halves at ``I`` (a real split needs autograd ``GradientEdge``
  s or a split AOT backward graph, see the design note).

Every builder runs each stage's backwards in increasing microbatch order, so the per-parameter sums are added
in the same order as the one-stage step's and the result is bitwise equal. Nothing is divided: the caller owns
``1/Σw``. Ranks are interleaved in a lock-step dry run of the compute actions (sends and receives are implicit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.func import vjp

from d9dfn._types import Buffers, Params
from d9dfn.pipeline._program import Action, Program, validate
from d9dfn.pipeline._stage import Stage

__all__ = ["ProgramResult", "execution_order", "run_forward", "run_program"]

LossFn = Callable[[Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, Any]]
"""``loss(outputs, microbatch_state) -> (w·ℓ, aux)``; ``aux``'s last item is the detached weight ``w``."""


class ProgramResult(NamedTuple):
    """What a training program leaves for the step's tail.

    Attributes:
        sums: ``(Σwᵢ∇ℓᵢ, Σwᵢℓᵢ, Σwᵢ)``; the gradients cover every trainable param, keyed as ``params``.
        buffers: every buffer after the forwards, each stage's updated in its ``F`` order.
        outs: per microbatch, in microbatch order, the ``aux`` the loss returned.
    """

    sums: tuple[Params, torch.Tensor, torch.Tensor]
    buffers: Buffers
    outs: list[Any]


def execution_order(program: Program) -> list[Action]:
    """The program's compute actions in one order that respects every dependency across ranks.

    Lock-step: each round, every rank runs its next action if its input exists (``F`` needs the previous
    stage's ``F``; ``B``/``I`` the next stage's ``B``/``I``, or the own ``F`` on the last stage).

    Raises:
        ValueError: the program is invalid, or no rank can move (a deadlock), naming each rank's blocked action.
    """
    validate(program)
    last = program.num_stages - 1
    rows = [[a for a in row if a.is_compute] for row in program.compute_only().ranks]
    heads = [0] * len(rows)
    done: set[tuple[int, str, int]] = set()
    order: list[Action] = []

    def ready(action: Action) -> bool:
        s, i = action.stage, action.microbatch
        if action.kind == "F":
            return s == 0 or (s - 1, "F", i) in done
        if action.kind in "BI":
            return (s, "F", i) in done if s == last else ((s + 1, "B", i) in done or (s + 1, "I", i) in done)
        return (s, "I", i) in done

    while any(head < len(row) for head, row in zip(heads, rows, strict=True)):
        moved = False
        for rank, row in enumerate(rows):
            if heads[rank] < len(row) and ready(row[heads[rank]]):
                action = row[heads[rank]]
                order.append(action)
                done.add((action.stage, action.kind, action.microbatch))
                heads[rank] += 1
                moved = True
        if not moved:
            blocked = [f"r{r}: {row[h]}" for r, (h, row) in enumerate(zip(heads, rows, strict=True)) if h < len(row)]
            raise ValueError(f"execution_order: no rank can move (deadlock); blocked at {', '.join(blocked)}")
    return order


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _check_stages(owner: str, program: Program, stages: Sequence[Stage]) -> None:
    if len(stages) != program.num_stages or any(stage.index != s for s, stage in enumerate(stages)):
        raise ValueError(
            f"{owner}: the program has {program.num_stages} stages but got stages with indices "
            f"{[stage.index for stage in stages]}; pass one Stage per program stage, in stage order"
        )


def _stage_args(stage: Stage, params: Params, buffers: Buffers) -> tuple[Params, Params, Buffers]:
    """(trainable params, frozen params, buffers) of ``stage``: frozen params live in the step's ``buffers``."""
    trainable = {name: params[name] for name in params if name in stage.param_names}
    frozen = {name: buffers[name] for name in stage.param_names if name not in params}
    return trainable, frozen, {name: buffers[name] for name in stage.buffer_names}


def run_program(
    program: Program,
    stages: Sequence[Stage],
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    loss: LossFn,
    *,
    sums: tuple[Params, torch.Tensor, torch.Tensor] | None = None,
) -> ProgramResult:
    """Run a training program (``F`` and ``B``, or ``F``, ``I`` and ``W``) over ``stages``; no division by anything.

    Args:
        program: a valid program with a backward for every (stage, microbatch).
        stages: one :class:`~d9dfn.pipeline.Stage` per program stage, in order.
        params: the trainable params of the whole model (plain tensors), full names.
        buffers: the module buffers and frozen params of the whole model.
        microbatches: per microbatch ``(inputs, kwargs, state)``: ``inputs`` feed stage 0, ``kwargs`` every stage,
            ``state`` the loss.
        loss: on the last stage's outputs, ``(w·ℓ, aux)`` with ``aux[-1]`` the detached float32 weight ``w``.
        sums: where to start accumulating (e.g. zeros); ``None``: zeros.

    Returns:
        The sums, the new buffers and the losses' ``aux`` per microbatch.

    Raises:
        ValueError: a forward-only program, stages that do not match, or an order that deadlocks.
    """
    _check_stages("run_program", program, stages)
    if not any(a.kind in "BI" for row in program.ranks for a in row):
        raise ValueError("run_program: the program has no backward; run a forward-only program with run_forward")
    if len(microbatches) != program.num_microbatches:
        raise ValueError(
            f"run_program: {len(microbatches)} microbatches for a program of {program.num_microbatches}; split the "
            "batch into the program's count"
        )
    last = program.num_stages - 1
    buffers = dict(buffers)
    if sums is None:
        device = next(iter(params.values())).device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        sums = ({name: torch.zeros_like(p) for name, p in params.items()}, zero, zero)
    grad_sum = dict(sums[0])
    stage_inputs: dict[tuple[int, int], dict[str, Any]] = {}
    closures: dict[tuple[int, int], Callable[..., Any]] = {}
    output_like: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    output_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    held_weight_grads: dict[tuple[int, int], Params] = {}
    losses: dict[int, tuple[torch.Tensor, Any]] = {}

    def forward(s: int, i: int) -> None:
        stage = stages[s]
        inputs, kwargs, state = microbatches[i]
        inputs = inputs if s == 0 else stage_inputs.pop((s, i))
        trainable, frozen, stage_buffers = _stage_args(stage, params, buffers)
        # Stage 0's inputs are data: differentiate the params only (the one-stage step does not either).
        diff = {} if s == 0 else {k: v for k, v in inputs.items() if _is_float(v)}
        rest = {k: v for k, v in inputs.items() if k not in diff}

        def fn(p: Params, x: dict[str, torch.Tensor]) -> tuple[Any, tuple[Buffers, Any]]:
            outputs, new_buffers = stage({**p, **frozen}, stage_buffers, {**rest, **x}, kwargs)
            if s == last:
                weighted_loss, aux = loss(outputs, state)
                return weighted_loss, (new_buffers, aux)
            return {k: v for k, v in outputs.items() if _is_float(v)}, (new_buffers, outputs)

        primal, closure, (new_buffers, aux) = vjp(fn, trainable, diff, has_aux=True)  # type: ignore[misc]  # torch.func.vjp's stub omits has_aux's third value
        buffers.update(new_buffers)
        closures[(s, i)] = closure
        if s == last:
            losses[i] = (primal.detach(), aux)
            output_grads[(s, i)] = torch.ones_like(primal)  # type: ignore[assignment]  # the loss's cotangent is a tensor
        else:
            output_like[(s, i)] = primal
            stage_inputs[(s + 1, i)] = {k: primal.get(k, v) for k, v in aux.items()}

    def backward(s: int, i: int, hold: bool) -> None:
        cotangent = output_grads.pop((s, i))
        if s != last:  # outputs the next stage did not use get zero gradients
            like = output_like.pop((s, i))
            cotangent = {k: cotangent[k] if k in cotangent else torch.zeros_like(v) for k, v in like.items()}
        weight_grads, input_grads = closures.pop((s, i))(cotangent)
        if s > 0:
            output_grads[(s - 1, i)] = input_grads
        if hold:
            held_weight_grads[(s, i)] = weight_grads
        else:
            accumulate(weight_grads)

    def accumulate(weight_grads: Params) -> None:
        for name, g in weight_grads.items():
            grad_sum[name] = grad_sum[name] + g

    for action in execution_order(program):
        s, i = action.stage, action.microbatch
        if action.kind == "F":
            forward(s, i)
        elif action.kind in "BI":
            backward(s, i, hold=action.kind == "I")
        else:
            accumulate(held_weight_grads.pop((s, i)))
    loss_sum, weight_sum = sums[1], sums[2]
    for i in range(program.num_microbatches):  # microbatch order, as the one-stage loop adds them
        weighted_loss, aux = losses[i]
        loss_sum, weight_sum = loss_sum + weighted_loss, weight_sum + aux[-1]
    return ProgramResult((grad_sum, loss_sum, weight_sum), buffers, [losses[i][1] for i in range(len(losses))])


def run_forward(
    program: Program,
    stages: Sequence[Stage],
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
) -> list[dict[str, Any]]:
    """Run a program's forwards only (any program; backwards are skipped) without gradients.

    Returns:
        The last stage's outputs per microbatch, in microbatch order. Buffer updates are discarded, as the eval
        and inference steps discard them.
    """
    _check_stages("run_forward", program, stages)
    last = program.num_stages - 1
    stage_inputs: dict[tuple[int, int], dict[str, Any]] = {}
    outputs: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for action in execution_order(program):
            if action.kind != "F":
                continue
            s, i = action.stage, action.microbatch
            inputs, kwargs, _ = microbatches[i]
            trainable, frozen, stage_buffers = _stage_args(stages[s], params, buffers)
            out, _ = stages[s](
                {**trainable, **frozen}, stage_buffers, inputs if s == 0 else stage_inputs.pop((s, i)), kwargs
            )
            if s == last:
                outputs[i] = out
            else:
                stage_inputs[(s + 1, i)] = out
    return [outputs[i] for i in range(program.num_microbatches)]
