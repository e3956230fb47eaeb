"""The reference executor: a :class:`~d9dfn.pipeline.Program` interpreted with every stage in one process.

It is the oracle a multi-rank executor is checked against, and what ``make_train_step(executor=Pipeline(...))``
runs. Per action (``docs/design/pipeline.md``, "Executors"):

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

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.func import vjp

from d9dfn._types import Buffers, Params, Sums
from d9dfn.pipeline._program import Action, Program, validate
from d9dfn.pipeline._split_backward import SplitBackward
from d9dfn.pipeline._stage import Stage

__all__ = [
    "Pipeline",
    "ProgramResult",
    "StageCall",
    "StageConsts",
    "StageRunner",
    "TracedStages",
    "execution_order",
    "run_forward",
    "run_program",
    "stage_args",
]

LossFn = Callable[[Mapping[str, torch.Tensor], Any], tuple[torch.Tensor, Any]]
"""``loss(outputs, microbatch_state) -> (w·ℓ, aux)``; ``aux``'s last item is the detached weight ``w``."""

StageCall = Callable[[Stage, Params, Buffers, Mapping[str, Any], Mapping[str, Any]], tuple[dict[str, Any], Buffers]]
"""How a stage runs as a pure function: ``call(stage, params, buffers, inputs, kwargs) -> (outputs, new buffers)``
(default ``Stage.__call__``; the step passes one that casts to its precision policy's compute dtype first)."""


class ProgramResult(NamedTuple):
    """What a training executor leaves for the step's tail (every executor returns it, pipelined or not).

    Attributes:
        sums: ``(Σwᵢ∇ℓᵢ, Σwᵢℓᵢ, Σwᵢ)``; the gradients cover every trainable param, keyed as ``params``.
        buffers: every buffer after the forwards, each stage's updated in its ``F`` order.
        outs: per microbatch, in microbatch order, the ``aux`` the loss returned.
    """

    sums: Sums
    buffers: Buffers
    outs: list[Any]


class StageConsts(NamedTuple):
    """What a stage's forward reads but is not differentiated with respect to."""

    frozen: Params
    buffers: Buffers
    rest: dict[str, Any]  # the inputs that are not floating tensors (ids, masks), and stage 0's data
    kwargs: dict[str, Any]
    state: Any  # the microbatch's state, for the loss on the last stage


Post = Callable[[dict[str, Any], StageConsts], tuple[Any, Any]]
"""``post(outputs, consts) -> (primal, aux)``: what a stage's forward ends with (the loss on the last stage, the
floating outputs elsewhere); traced and compiled with the stage."""


class StageRunner(Protocol):
    """How the interpreter runs one stage: a forward that keeps its backward for later, or a forward alone.

    ``vjp`` returns ``(primal, closure, aux, new_buffers)``; ``closure(cotangent)`` gives ``(weight_grads,
    input_grads)`` and, for programs with ``I``/``W`` actions, ``closure.input(cotangent)`` then
    ``closure.weight()`` give the two halves. :class:`TracedStages` is the default; the step's per-block runner
    (``d9dfn.step``) is the other.
    """

    call: StageCall
    """The functional form of a stage call (the boundary shapes are found with it, on meta tensors)."""

    def for_program(self, program: Program) -> StageRunner:
        """The runner to use for ``program`` (e.g. one that can split the backward when ``program`` has ``I``/``W``)."""
        ...

    def vjp(
        self, stage: Stage, post: Post, trainable: Params, inputs: dict[str, Any], consts: StageConsts
    ) -> tuple[Any, Any, Any, Buffers]: ...

    def forward(
        self, stage: Stage, params: Params, buffers: Buffers, inputs: Mapping[str, Any], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]: ...


def _call_stage(
    stage: Stage, params: Params, buffers: Buffers, inputs: Mapping[str, Any], kwargs: Mapping[str, Any]
) -> tuple[dict[str, Any], Buffers]:
    return stage(params, buffers, inputs, kwargs)


class TracedStages:
    """Each stage as a pure function of its params and inputs: ``torch.func.vjp`` eagerly, or traced once into
    ``fw``/``dI``/``dW`` graphs by a :class:`SplitBackward` (programs with ``I``/``W`` actions, and every program
    when ``split`` compiles its pieces); forwards alone run ``forward`` (``call``, or its compiled form).

    Args:
        split: the traced-graph cache to use (keep one per step function, so each stage is traced once); ``None``:
            ``vjp``, or a fresh split for a program with ``I``/``W`` actions.
        call: how a stage is called (default ``Stage.__call__``).
        compile_forward: compiles a stage's forward-only call once per stage (e.g. ``torch.compile``); ``None``:
            eager.
    """

    def __init__(
        self,
        split: SplitBackward | None = None,
        call: StageCall = _call_stage,
        compile_forward: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    ) -> None:
        self.split, self.call, self._compile_forward = split, call, compile_forward
        self._forwards: dict[int, Callable[..., Any]] = {}

    def for_program(self, program: Program) -> TracedStages:
        """``vjp`` for a program of ``F``/``B`` unless the split compiles; a split for a program with ``I``/``W``."""
        if any(a.kind == "I" for row in program.ranks for a in row):
            return self if self.split is not None else TracedStages(SplitBackward(), self.call, self._compile_forward)
        if self.split is not None and not self.split.compiles:  # eager F/B: vjp, bitwise the one-stage step
            unsplit = TracedStages(None, self.call, self._compile_forward)
            unsplit._forwards = self._forwards
            return unsplit
        return self

    def vjp(
        self, stage: Stage, post: Post, trainable: Params, inputs: dict[str, Any], consts: StageConsts
    ) -> tuple[Any, Any, Any, Buffers]:
        call = self.call

        def fn(p: Params, x: dict[str, torch.Tensor], c: StageConsts) -> tuple[Any, tuple[Buffers, Any]]:
            outputs, new_buffers = call(stage, {**p, **c.frozen}, c.buffers, {**c.rest, **x}, c.kwargs)
            primal, aux = post(outputs, c)
            return primal, (new_buffers, aux)

        closure: Any  # a vjp closure, or a SplitVjp
        if self.split is not None:
            primal, closure, (new_buffers, aux) = self.split(stage.index, fn, trainable, inputs, consts)
        else:
            primal, vjp_fn, (new_buffers, aux) = vjp(  # type: ignore[misc]  # the stub omits has_aux's third value
                lambda p, x: fn(p, x, consts), trainable, inputs, has_aux=True
            )
            # The backward formulas as the one-stage step's (torch.func.grad_and_value) and the split's (traced under
            # enable_grad) pick them, whatever the caller's grad mode: vjp's closure otherwise takes create_graph from
            # torch.is_grad_enabled(), and with it off autograd runs first-order kernels (silu_backward where the
            # others run sigmoid, mul, add), which round differently on AVX2/AVX-512 (docs/design/pipeline.md,
            # "Which backward formulas").
            closure = functools.partial(vjp_fn, create_graph=True)
        return primal, closure, aux, new_buffers

    def forward(
        self, stage: Stage, params: Params, buffers: Buffers, inputs: Mapping[str, Any], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        if self._compile_forward is None:
            return self.call(stage, params, buffers, inputs, kwargs)[0]
        if stage.index not in self._forwards:
            call = self.call

            def forward(p: Params, b: Buffers, x: Mapping[str, Any], kw: Mapping[str, Any]) -> dict[str, Any]:
                return call(stage, p, b, x, kw)[0]

            self._forwards[stage.index] = self._compile_forward(forward)
        return self._forwards[stage.index](params, buffers, inputs, kwargs)  # type: ignore[no-any-return]


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


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A program over stages that this one process all holds: the reference executor (``run_program``).

    Pass it as ``make_train_step(executor=...)``: bitwise the one-stage step in eager, the oracle a multi-rank
    executor (:class:`~d9dfn.pipeline.PipelineRank`) is checked against.

    Attributes:
        program: the program to interpret.
        stages: one :class:`Stage` per program stage, in stage order.
    """

    program: Program
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        _check_stages("Pipeline", self.program, self.stages)


def stage_args(stage: Stage, params: Params, buffers: Buffers) -> tuple[Params, Params, Buffers]:
    """(trainable params, frozen params, buffers) of ``stage``: ``params`` are the ones differentiated; a stage param
    not among them is frozen and comes with the constants in ``buffers`` (the train step takes its frozen params out
    of the train state's ``params``, ``TrainState.frozen``, placed and gathered like the others, and hands them over
    there; an eval or inference step hands every param in ``params``)."""
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
    resolved by :meth:`_take`). Nothing is divided. How a stage's forward and backward run is the runner's
    (:class:`StageRunner`).
    """

    def __init__(
        self,
        program: Program,
        stages: Mapping[int, Stage],
        params: Params,
        buffers: Buffers,
        microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
        loss: LossFn,
        sums: Sums | None,
        runner: StageRunner,
        wait: Callable[[Any], Any] = lambda value: value,
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
        self.runner = runner.for_program(program)
        if sums is None:
            device = next(iter(params.values())).device
            zero = torch.zeros((), dtype=torch.float32, device=device)
            sums = Sums({name: torch.zeros_like(p) for name, p in params.items()}, zero, zero)
        self.grad_sum, self.loss_sum, self.weight_sum = dict(sums[0]), sums[1], sums[2]
        self.inputs: dict[tuple[int, int], Any] = {}
        self.output_grads: dict[tuple[int, int], Any] = {}
        self.closures: dict[tuple[int, int], Any] = {}  # what each F left for its backward
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

    def post(self, s: int) -> Post:
        """The end of stage ``s``'s forward: the loss on the last stage, its floating outputs elsewhere."""
        last, loss = self.last, self.loss

        def post(outputs: dict[str, Any], c: StageConsts) -> tuple[Any, Any]:
            if s == last:
                return loss(outputs, c.state)
            return {k: v for k, v in outputs.items() if _is_float(v)}, outputs

        return post

    def forward(self, s: int, i: int) -> None:
        stage = self.stages[s]
        inputs, kwargs, state = self.microbatches[i]
        inputs = inputs if s == 0 else self.wait(self.inputs.pop((s, i)))
        trainable, frozen, stage_buffers = stage_args(stage, self.params, self.buffers)
        # Stage 0's inputs are data: differentiate the params only (the one-stage step does not either).
        diff = {} if s == 0 else {k: v for k, v in inputs.items() if _is_float(v)}
        rest = {k: v for k, v in inputs.items() if k not in diff}
        consts = StageConsts(frozen, stage_buffers, rest, kwargs, state)
        primal, closure, aux, new_buffers = self.runner.vjp(stage, self.post(s), trainable, diff, consts)
        self.buffers.update(new_buffers)
        self.closures[(s, i)] = closure
        if s == self.last:
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
        return ProgramResult(Sums(self.grad_sum, loss_sum, weight_sum), self.buffers, outs)


def _check_training(owner: str, program: Program, microbatches: Sequence[Any]) -> None:
    if not any(a.kind in "BI" for row in program.ranks for a in row):
        raise ValueError(f"{owner}: the program has no backward; run a forward-only program with run_forward")
    if len(microbatches) != program.num_microbatches:
        raise ValueError(
            f"{owner}: {len(microbatches)} microbatches for a program of {program.num_microbatches}; split the "
            "batch into the program's count"
        )


def _runner(runner: StageRunner | None, split: SplitBackward | None) -> StageRunner:
    if runner is not None and split is not None:
        raise ValueError("run_program: pass runner= or split=, not both (a TracedStages holds its SplitBackward)")
    return runner if runner is not None else TracedStages(split)


def run_program(
    program: Program,
    stages: Sequence[Stage],
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    loss: LossFn,
    *,
    sums: Sums | None = None,
    split: SplitBackward | None = None,
    runner: StageRunner | None = None,
) -> ProgramResult:
    """Run a training program (``F`` and ``B``, or ``F``, ``I`` and ``W``) over ``stages``; no division by anything.

    Args:
        program: a valid program with a backward for every (stage, microbatch).
        stages: one :class:`~d9dfn.pipeline.Stage` per program stage, in order.
        params: the trainable params of the whole model (plain tensors), full names.
        buffers: the module buffers and the frozen params (as the model computes with them) of the whole model.
        microbatches: per microbatch ``(inputs, kwargs, state)``: ``inputs`` feed stage 0, ``kwargs`` every stage,
            ``state`` the loss.
        loss: on the last stage's outputs, ``(w·ℓ, aux)`` with ``aux[-1]`` the detached float32 weight ``w``.
        sums: where to start accumulating (e.g. zeros); ``None``: zeros.
        split: the I/W graph cache to use for a program with ``I`` actions (keep one per step function, so each
            stage is traced once); ``None``: a fresh one for this call. A compiling one
            (``SplitBackward(compile=...)``) runs every program's ``F`` and ``B`` through its compiled pieces too.
            ``loss`` must read every per-step tensor from its ``state`` argument, never from a closure (a traced
            graph keeps a closure's tensor as a constant). Shorthand for ``runner=TracedStages(split)``.
        runner: how each stage runs (:class:`StageRunner`); default :class:`TracedStages`.

    Returns:
        The sums, the new buffers and the losses' ``aux`` per microbatch.

    Raises:
        ValueError: a forward-only program, stages that do not match, or an order that deadlocks.
    """
    _check_stages("run_program", program, stages)
    _check_training("run_program", program, microbatches)
    interpreter = _Interpreter(
        program, dict(enumerate(stages)), params, buffers, microbatches, loss, sums, _runner(runner, split)
    )
    for action in execution_order(program):
        interpreter.run(action)
    return interpreter.result()


def run_forward(
    program: Program,
    stages: Sequence[Stage],
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    *,
    runner: StageRunner | None = None,
) -> list[dict[str, Any]]:
    """Run a program's forwards only (any program; backwards are skipped) without gradients.

    Returns:
        The last stage's outputs per microbatch, in microbatch order. Buffer updates are discarded, as the eval
        and inference steps discard them.
    """
    _check_stages("run_forward", program, stages)
    runner = _runner(runner, None)
    last = program.num_stages - 1
    stage_inputs: dict[tuple[int, int], dict[str, Any]] = {}
    outputs: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for action in execution_order(program):
            if action.kind != "F":
                continue
            s, i = action.stage, action.microbatch
            inputs, kwargs, _ = microbatches[i]
            trainable, frozen, stage_buffers = stage_args(stages[s], params, buffers)
            out = runner.forward(
                stages[s],
                {**trainable, **frozen},
                stage_buffers,
                inputs if s == 0 else stage_inputs.pop((s, i)),
                kwargs,
            )
            if s == last:
                outputs[i] = out
            else:
                stage_inputs[(s + 1, i)] = out
    return [outputs[i] for i in range(program.num_microbatches)]
