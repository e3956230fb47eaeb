"""The reference executor: a :class:`~d9dfn.pipeline.Program` interpreted with every stage in one process.

It is the oracle a multi-rank executor is checked against, and what ``make_train_step(pipeline=...)`` runs. Per
action (``docs/design/pipeline.md``, "Executors"):

- ``F`` runs the stage's pure function under ``torch.func.vjp`` and keeps the backward closure; on the last stage
  it also runs the caller's ``loss(outputs, state) -> (w·ℓ, aux)``.
- ``B`` calls the closure with the output gradients (``1`` for the last stage's ``w·ℓ``), adds the weight
  gradients into ``Σw∇ℓ`` and hands the input gradients to the previous stage.
- In a program with ``I``/``W`` actions, ``F`` runs the stage's traced ``fw`` graph instead
  (``_split_backward.SplitBackward``: each stage traced once per argument shape into ``fw``/``dI``/``dW``, cached
  for as long as the caller keeps the ``SplitBackward``, e.g. a built step); ``I`` runs ``dI`` (the input
  gradients, and the live intermediates ``dW`` needs), ``W`` runs ``dW`` and adds the weight gradients. No
  matmul runs twice, and the result equals ``vjp`` bitwise.
- With a compiling ``SplitBackward`` (``make_train_step(compile=True)``) every program runs that way, ``B`` as
  ``dI`` then ``dW``: each stage's ``fw``/``dI``/``dW`` pieces are compiled once and run for every microbatch.

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
from d9dfn.pipeline._split_backward import SplitBackward
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


class _Interpreter:
    """The compute actions of a training program over the stages one process holds (all, or one rank's).

    In-flight values live in two mailboxes keyed by the stage that *consumes* them: ``inputs[(s, i)]`` (stage
    ``s``'s activations for microbatch ``i``) and ``output_grads[(s, i)]`` (the cotangent of stage ``s``'s
    outputs). ``F`` of stage ``s`` posts into ``inputs[(s + 1, i)]`` and ``B``/``I`` into ``output_grads[(s - 1,
    i)]``; the single-process reference reads them from there directly, a multi-rank executor sends them
    (``SEND_*`` pops the entry) or lets a receive fill them (``RECV_*``; a value may be a pending receive,
    resolved by :meth:`_take`). Nothing is divided.
    """

    def __init__(
        self,
        program: Program,
        stages: Mapping[int, Stage],
        params: Params,
        buffers: Buffers,
        microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
        loss: LossFn,
        sums: tuple[Params, torch.Tensor, torch.Tensor] | None,
        wait: Callable[[Any], Any] = lambda value: value,
        split: SplitBackward | None = None,
    ) -> None:
        self.program, self.stages, self.params, self.microbatches, self.loss = (
            program,
            stages,
            params,
            microbatches,
            loss,
        )
        self.last = program.num_stages - 1
        self.buffers = dict(buffers)
        self.wait = wait
        # Programs with I/W actions trace each stage into fw/dI/dW graphs (``_split_backward``); the caller may
        # pass a SplitBackward it keeps across steps, so each stage is traced once per shape, not once per step.
        # A compiling SplitBackward runs every backward form (B too, as dI then dW) through its compiled pieces.
        has_split = any(a.kind == "I" for row in program.ranks for a in row) or (split is not None and split.compiles)
        self.split = (split if split is not None else SplitBackward()) if has_split else None
        if sums is None:
            device = next(iter(params.values())).device
            zero = torch.zeros((), dtype=torch.float32, device=device)
            sums = ({name: torch.zeros_like(p) for name, p in params.items()}, zero, zero)
        self.grad_sum, self.loss_sum, self.weight_sum = dict(sums[0]), sums[1], sums[2]
        self.inputs: dict[tuple[int, int], Any] = {}
        self.output_grads: dict[tuple[int, int], Any] = {}
        self.closures: dict[tuple[int, int], Any] = {}  # vjp closures, or SplitVjp (I/W programs)
        self.output_like: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.held_weight_grads: dict[tuple[int, int], Callable[[], Params]] = {}
        self.losses: dict[int, tuple[torch.Tensor, Any]] = {}

    def run(self, action: Action) -> None:
        s, i = action.stage, action.microbatch
        if action.kind == "F":
            self.forward(s, i)
        elif action.kind in "BI":
            self.backward(s, i, hold=action.kind == "I")
        elif action.kind == "W":
            self.accumulate(self.held_weight_grads.pop((s, i))())
        else:
            raise AssertionError(f"the interpreter runs compute actions only, got {action}")

    def forward(self, s: int, i: int) -> None:
        stage = self.stages[s]
        inputs, kwargs, state = self.microbatches[i]
        inputs = inputs if s == 0 else self.wait(self.inputs.pop((s, i)))
        trainable, frozen, stage_buffers = _stage_args(stage, self.params, self.buffers)
        # Stage 0's inputs are data: differentiate the params only (the one-stage step does not either).
        diff = {} if s == 0 else {k: v for k, v in inputs.items() if _is_float(v)}
        rest = {k: v for k, v in inputs.items() if k not in diff}
        last, loss = self.last, self.loss

        def fn(p: Params, x: dict[str, torch.Tensor], c: tuple[Any, ...]) -> tuple[Any, tuple[Buffers, Any]]:
            frozen, stage_buffers, rest, kwargs, state = c
            outputs, new_buffers = stage({**p, **frozen}, stage_buffers, {**rest, **x}, kwargs)
            if s == last:
                weighted_loss, aux = loss(outputs, state)
                return weighted_loss, (new_buffers, aux)
            return {k: v for k, v in outputs.items() if _is_float(v)}, (new_buffers, outputs)

        consts = (frozen, stage_buffers, rest, kwargs, state)
        closure: Any  # a vjp closure, or a SplitVjp (programs with I/W actions)
        if self.split is not None:
            primal, closure, (new_buffers, aux) = self.split(s, fn, trainable, diff, consts)
        else:
            primal, closure, (new_buffers, aux) = vjp(  # type: ignore[misc]  # the stub omits has_aux's third value
                lambda p, x: fn(p, x, consts), trainable, diff, has_aux=True
            )
        self.buffers.update(new_buffers)
        self.closures[(s, i)] = closure
        if s == last:
            self.losses[i] = (primal.detach(), aux)
            self.output_grads[(s, i)] = torch.ones_like(primal)
        else:
            self.output_like[(s, i)] = primal
            self.inputs[(s + 1, i)] = {k: primal.get(k, v) for k, v in aux.items()}

    def backward(self, s: int, i: int, hold: bool) -> None:
        cotangent = self.wait(self.output_grads.pop((s, i)))
        if s != self.last:  # outputs the next stage did not use get zero gradients
            like = self.output_like.pop((s, i))
            cotangent = {k: cotangent[k] if k in cotangent else torch.zeros_like(v) for k, v in like.items()}
        closure = self.closures.pop((s, i))
        if hold:  # I: the input gradients only; W runs dW later from what dI handed over
            input_grads = closure.input(cotangent)
            self.held_weight_grads[(s, i)] = closure.weight
        else:
            weight_grads, input_grads = closure(cotangent)
            self.accumulate(weight_grads)
        if s > 0:
            self.output_grads[(s - 1, i)] = input_grads

    def accumulate(self, weight_grads: Params) -> None:
        for name, g in weight_grads.items():
            self.grad_sum[name] = self.grad_sum[name] + g

    def result(self) -> ProgramResult:
        """The sums (losses in microbatch order, as the one-stage loop adds them), buffers and per-mb ``aux``."""
        loss_sum, weight_sum = self.loss_sum, self.weight_sum
        for i in sorted(self.losses):
            weighted_loss, aux = self.losses[i]
            loss_sum, weight_sum = loss_sum + weighted_loss, weight_sum + aux[-1]
        outs = [self.losses[i][1] for i in sorted(self.losses)]
        return ProgramResult((self.grad_sum, loss_sum, weight_sum), self.buffers, outs)


def _check_training(owner: str, program: Program, microbatches: Sequence[Any]) -> None:
    if not any(a.kind in "BI" for row in program.ranks for a in row):
        raise ValueError(f"{owner}: the program has no backward; run a forward-only program with run_forward")
    if len(microbatches) != program.num_microbatches:
        raise ValueError(
            f"{owner}: {len(microbatches)} microbatches for a program of {program.num_microbatches}; split the "
            "batch into the program's count"
        )


def run_program(
    program: Program,
    stages: Sequence[Stage],
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    loss: LossFn,
    *,
    sums: tuple[Params, torch.Tensor, torch.Tensor] | None = None,
    split: SplitBackward | None = None,
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
        split: the I/W graph cache to use for a program with ``I`` actions (keep one per step function, so each
            stage is traced once); ``None``: a fresh one for this call. A compiling one
            (``SplitBackward(compile=...)``) runs every program's ``F`` and ``B`` through its compiled pieces too.
            ``loss`` must read every per-step tensor from its ``state`` argument, never from a closure (a traced
            graph keeps a closure's tensor as a constant).

    Returns:
        The sums, the new buffers and the losses' ``aux`` per microbatch.

    Raises:
        ValueError: a forward-only program, stages that do not match, or an order that deadlocks.
    """
    _check_stages("run_program", program, stages)
    _check_training("run_program", program, microbatches)
    interpreter = _Interpreter(program, dict(enumerate(stages)), params, buffers, microbatches, loss, sums, split=split)
    for action in execution_order(program):
        interpreter.run(action)
    return interpreter.result()


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
