"""The multi-rank executor: one pipeline rank's lowered program, with sends and receives over the ``pp`` group.

The same interpreter as the single-process reference (``_executor._Interpreter``) runs the compute actions of
this rank's row of ``lower(program)``; the communication actions move the interpreter's mailbox entries
(``../shared/reference/pipeline.md`` §6.4):

- ``SEND_F``/``SEND_B`` pop the activations (or input gradients) the compute action just posted and ``isend``
  each tensor to the peer; the sends are drained at the end of the step.
- ``RECV_F``/``RECV_B`` post ``irecv`` s into buffers allocated from :func:`~d9dfn.pipeline.stage_io_shapes`
  (every rank runs every stage's meta skeleton on its own copy of the batch's shapes: no shape exchange);
  the consumer (``F`` or ``B``/``I``) waits for them.
- neighbouring stages on one rank (the V placement's turn) pass their tensors through the mailbox, untouched.

:func:`run_rank_forward` runs the forwards of any program the same way under ``no_grad`` (the eval and
inference steps): its ``F`` actions, lowered on their own, so only activations travel. An optional ``trace``
list records every action's ``time.perf_counter()`` interval (``benchmarks/pipeline.py``); off, nothing is timed.

Each message has its own tag (stage, microbatch, direction, tensor), so matching never depends on the order in
which the backend delivers. P2P stays outside compiled graphs (torch 2.13 has no functional send/recv): the
pieces may be compiled, the program is interpreted. Every wait is bounded by the ``pp`` group's timeout (gloo's
``Work.wait()`` without one would wait forever for a peer that stalls alive); a failed or timed-out send/receive
raises a ``RuntimeError`` that names this rank, the action, the microbatch, the peer and the step.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from d9dfn._types import Buffers, Params, Sums
from d9dfn.pipeline._executor import (
    LossFn,
    ProgramResult,
    StageCall,
    StageRunner,
    _check_stages,
    _check_training,
    _Interpreter,
    _runner,
    stage_args,
)
from d9dfn.pipeline._lower import lower
from d9dfn.pipeline._program import Action, Program
from d9dfn.pipeline._split_backward import SplitBackward
from d9dfn.pipeline._stage import Stage, stage_io_shapes

__all__ = ["PipelineRank", "run_rank_forward", "run_rank_program"]


@dataclasses.dataclass(frozen=True)
class PipelineRank:
    """What one pipeline rank runs: a program's row, the stages it holds, and the ``pp`` group to talk over.

    Pass it as ``make_train_step(executor=...)``; the step then runs :func:`run_rank_program` and reduces the
    loss, the loss weight and the gradient norm over ``group`` (``d9dfn.parallel.pipeline_reduction``).

    Attributes:
        program: the compute program (lowered here); ``program.ranks[rank]`` is this rank's row.
        stages: every stage's skeleton (meta, cheap), in stage order: the boundary shapes come from them and
            the whole model's param order for the global norm. Only this rank's stages ever see real tensors.
        rank: this rank's position in ``group`` (``d9dfn.parallel.pipeline_rank(mesh)``).
        group: the ``pp`` process group (``d9dfn.parallel.pipeline_group(mesh)``).
        trace: a profiling hook: a list that :func:`run_rank_program` and :func:`run_rank_forward` append
            ``(action, start, end)`` to (``time.perf_counter()`` seconds) for every action they run; ``None``
            (the default): nothing is timed. The caller owns and clears the list (``benchmarks/pipeline.py``).
    """

    program: Program
    stages: tuple[Stage, ...]
    rank: int
    group: Any
    trace: list[tuple[Action, float, float]] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_stages("PipelineRank", self.program, self.stages)
        if not 0 <= self.rank < self.program.num_ranks:
            raise ValueError(
                f"PipelineRank: rank={self.rank} but the program has {self.program.num_ranks} ranks; pass "
                "d9dfn.parallel.pipeline_rank(mesh) with a program built for the mesh's pipeline degree"
            )
        size = self.group.size() if hasattr(self.group, "size") else None
        if size is not None and size != self.program.num_ranks:
            raise ValueError(
                f"PipelineRank: the pp group has {size} ranks but the program {self.program.num_ranks}; build the "
                f"program with num_ranks={size}"
            )
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def local_stages(self) -> tuple[Stage, ...]:
        """The stages this rank holds, in stage order."""
        return tuple(s for s in self.stages if self.program.stage_to_rank[s.index] == self.rank)

    @property
    def param_names(self) -> tuple[str, ...]:
        """Every stage's param names, stage by stage in each skeleton's order (the whole model's order when the
        model lists its params in stage order, as a sequential model does)."""
        return tuple(name for s in self.stages for name, _ in s.module.named_parameters())


class _Pending:
    """A posted receive: the mailbox value, ready once every ``work`` completed."""

    def __init__(self, value: dict[str, Any], works: list[Any], action: Action, peer: int) -> None:
        self.value, self.works, self.action, self.peer = value, works, action, peer


def _tag(program: Program, stage: int, microbatch: int, backward: bool, index: int) -> int:
    # One tag per message: ((sending stage, microbatch), direction, tensor index); 64 tensors per boundary.
    return ((stage * program.num_microbatches + microbatch) * 2 + backward) * 64 + index


def _tensor_names(spec: Mapping[str, Any], floats_only: bool) -> list[str]:
    names = sorted(k for k, v in spec.items() if isinstance(v, torch.Tensor))
    return [k for k in names if spec[k].is_floating_point()] if floats_only else names


def _io_shapes(
    stages: Sequence[Stage], microbatch: tuple[dict[str, Any], dict[str, Any], Any], call: StageCall
) -> tuple[dict[str, torch.Tensor], ...]:
    inputs, kwargs, _ = microbatch
    rows = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim > 0), 1)
    return stage_io_shapes(stages, inputs, kwargs, microbatch_size=rows, call=call)


def _check_local_params(owner: str, pipeline: PipelineRank, params: Params, buffers: Buffers) -> dict[int, Stage]:
    local = {s.index: s for s in pipeline.local_stages}
    for stage in local.values():
        missing = sorted(stage.param_names - params.keys() - buffers.keys())
        if missing:
            raise ValueError(
                f"{owner}: stage {stage.index}'s param {missing[0]!r} is in neither params nor buffers; a "
                "weight tied across stages (e.g. the embedding and the LM head) is not supported: untie it "
                "(tie_word_embeddings=False) or keep both uses on one stage; otherwise pass this rank's params"
            )
    return local


class _Mailboxes(Protocol):
    """What the channel needs of an interpreter: its two mailboxes and a way to run a compute action."""

    inputs: dict[tuple[int, int], Any]
    output_grads: dict[tuple[int, int], Any]

    def run(self, action: Action) -> None: ...


class _Channel:
    """One step of one rank's lowered row: compute actions go to the interpreter, the rest over the ``pp`` group.

    ``SEND_*`` pops the mailbox entry a compute action posted and ``isend`` s each tensor; ``RECV_*`` posts
    ``irecv`` s into fresh buffers shaped like the sender's meta outputs and leaves a :class:`_Pending` in the
    consumer's mailbox; a compute action first waits for its pending input (so its own time excludes the wait).
    """

    def __init__(
        self,
        pipeline: PipelineRank,
        shapes: tuple[dict[str, torch.Tensor], ...],
        device: torch.device,
        step: torch.Tensor | None,
        trace: list[tuple[Action, float, float]] | None,
        owner: str,
    ) -> None:
        self.owner = owner
        self.program, self.rank, self.group = pipeline.program, pipeline.rank, pipeline.group
        self.shapes, self.device, self.step, self.trace = shapes, device, step, trace
        self.sends: list[tuple[Any, Action, int, torch.Tensor]] = []
        self.timeout = _group_timeout(self.group, device)

    def _wait(self, work: Any) -> None:
        # gloo's Work.wait() without an argument ignores the group's timeout: a peer that stalls alive would hold
        # this rank forever (measured by the loop's tests: 40 s for a 40 s stall with a 5 s step_timeout).
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def fail(self, action: Action, peer: int, error: BaseException) -> RuntimeError:
        at = "" if self.step is None else f" at step {int(self.step)}"
        return RuntimeError(
            f"{self.owner}: pipeline rank {self.rank}{at}: {action} (microbatch {action.microbatch}) with "
            f"pipeline rank {peer} failed ({type(error).__name__}: {error}); that rank died or did not answer "
            "within the process group's timeout: check its log, then rerun (resume from the last checkpoint)"
        )

    def wait(self, value: Any) -> Any:
        """``value`` itself, or a pending receive's value once it arrived (the wait is traced as its RECV)."""
        if not isinstance(value, _Pending):
            return value
        start = time.perf_counter() if self.trace is not None else 0.0
        for work in value.works:
            try:
                self._wait(work)
            except Exception as error:  # gloo: RuntimeError on a closed pair or a timeout
                raise self.fail(value.action, value.peer, error) from error
        if self.trace is not None:
            self.trace.append((value.action, start, time.perf_counter()))
        return value.value

    def run(self, row: Sequence[Action], interpreter: _Mailboxes) -> None:
        """Run ``row`` (this rank's actions of a lowered program), then drain the sends."""
        trace = self.trace
        for action in row:
            start = time.perf_counter() if trace is not None else 0.0
            if action.is_compute:
                s, i = action.stage, action.microbatch
                box = interpreter.inputs if action.kind == "F" else interpreter.output_grads
                if action.kind != "W" and isinstance(box.get((s, i)), _Pending):
                    box[(s, i)] = self.wait(box[(s, i)])  # the receive first: the action's own time excludes it
                    start = time.perf_counter() if trace is not None else 0.0
                interpreter.run(action)
            else:
                self.communicate(action, interpreter)
            if trace is not None:
                trace.append((action, start, time.perf_counter()))
        for work, action, peer, _ in self.sends:  # drain: every send's buffer stays alive until here
            start = time.perf_counter() if trace is not None else 0.0
            try:
                self._wait(work)
            except Exception as error:
                raise self.fail(action, peer, error) from error
            if trace is not None:
                trace.append((action, start, time.perf_counter()))

    def communicate(self, action: Action, interpreter: _Mailboxes) -> None:
        import torch.distributed as dist

        program, shapes, group = self.program, self.shapes, self.group
        s, i = action.stage, action.microbatch
        peer = program.stage_to_rank[s + _PEER_STAGE[action.kind]]
        destination = int(dist.get_global_rank(group, peer))
        try:
            if action.kind == "SEND_F":  # activations of stage s for stage s + 1
                value = interpreter.inputs.pop((s + 1, i))
                for j, name in enumerate(_tensor_names(shapes[s], floats_only=False)):
                    tensor = value[name].detach().contiguous()
                    tag = _tag(program, s, i, False, j)
                    self.sends.append((dist.isend(tensor, destination, group=group, tag=tag), action, peer, tensor))
            elif action.kind == "SEND_B":  # gradients of stage s - 1's outputs
                value = interpreter.output_grads.pop((s - 1, i))
                for j, name in enumerate(_tensor_names(shapes[s - 1], floats_only=True)):
                    grad = value.get(name)
                    like = shapes[s - 1][name]
                    tensor = (torch.zeros_like(like, device=self.device) if grad is None else grad).detach()
                    tensor = tensor.contiguous()
                    tag = _tag(program, s, i, True, j)
                    self.sends.append((dist.isend(tensor, destination, group=group, tag=tag), action, peer, tensor))
            else:
                forward = action.kind == "RECV_F"
                spec = shapes[s - 1] if forward else shapes[s]  # what the sender's stage outputs
                received: dict[str, Any] = dict(spec) if forward else {}  # non-tensor outputs are static
                works = []
                for j, name in enumerate(_tensor_names(spec, floats_only=not forward)):
                    buffer = torch.empty_like(spec[name], device=self.device)
                    tag = _tag(program, s - 1 if forward else s + 1, i, not forward, j)
                    works.append(dist.irecv(buffer, destination, group=group, tag=tag))
                    received[name] = buffer
                mailbox = interpreter.inputs if forward else interpreter.output_grads
                mailbox[(s, i)] = _Pending(received, works, action, peer)
        except Exception as error:
            raise self.fail(action, peer, error) from error


def _group_timeout(group: Any, device: torch.device) -> datetime.timedelta | None:
    """The ``pp`` group's current collective timeout (``set_collective_timeout`` may have lowered it), or ``None``
    when the group does not say (a wait then blocks as the backend does)."""
    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


_PEER_STAGE = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}
"""Which neighbour stage a communication action talks to."""


def run_rank_program(
    pipeline: PipelineRank,
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    loss: LossFn,
    *,
    sums: Sums | None = None,
    step: torch.Tensor | None = None,
    split: SplitBackward | None = None,
    runner: StageRunner | None = None,
    trace: list[tuple[Action, float, float]] | None = None,
) -> ProgramResult:
    """Run this rank's row of a training program; every rank of the ``pp`` group calls it with the same batch.

    Args:
        pipeline: the program, the stages and this rank's place (:class:`PipelineRank`).
        params: this rank's trainable params (its stages' only; plain tensors), full names.
        buffers: this rank's buffers and frozen params (as the model computes with them).
        microbatches: per microbatch ``(inputs, kwargs, state)``, the same on every pipeline rank (each runs the
            task's ``build_forward_inputs`` on the batch: cheap, no broadcast).
        loss: as :func:`~d9dfn.pipeline.run_program`; called on the last stage's rank only.
        sums: where to start accumulating; ``None``: zeros.
        step: the step, named in a communication error (read only then).
        split: the I/W graph cache (as :func:`~d9dfn.pipeline.run_program`).
        runner: how each stage runs (as :func:`~d9dfn.pipeline.run_program`).
        trace: a list to append ``(action, start, end)`` to for every action run, in ``time.perf_counter()``
            seconds (a profiling hook; ``None``: ``pipeline.trace``, and nothing is timed when that is ``None``
            too). A compute action's interval excludes the wait for its input, which is appended just before it
            under the ``RECV`` action that posted the receive; the sends drained at the end appear a second time.

    Returns:
        The local sums (``Σwℓ = Σw = 0`` without the last stage; the tail sums them over ``pp``), this rank's
        buffers, and the losses' ``aux`` per microbatch (empty without the last stage).

    Raises:
        ValueError: a forward-only program, or a local stage's param that ``params`` and ``buffers`` lack
            (e.g. a weight tied to another stage's).
        RuntimeError: a send or receive failed or timed out (a peer died), naming the action and the peer.
    """
    program = pipeline.program
    _check_training("run_rank_program", program, microbatches)
    local = _check_local_params("run_rank_program", pipeline, params, buffers)
    trace = pipeline.trace if trace is None else trace
    stages = _runner(runner, split)
    channel = _channel("run_rank_program", pipeline, params, microbatches, step, trace, stages.call)
    interpreter = _Interpreter(program, local, params, buffers, microbatches, loss, sums, stages, wait=channel.wait)
    channel.run(lower(program).ranks[pipeline.rank], interpreter)
    return interpreter.result()


def _channel(
    owner: str,
    pipeline: PipelineRank,
    params: Params,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    step: torch.Tensor | None,
    trace: list[tuple[Action, float, float]] | None,
    call: StageCall,
) -> _Channel:
    shapes = _io_shapes(pipeline.stages, microbatches[0], call)
    device = next(iter(params.values())).device if params else torch.device("cpu")
    return _Channel(pipeline, shapes, device, step, trace, owner)


class _Forwards:
    """The forwards of a program over one rank's stages, without gradients (the eval and inference steps)."""

    def __init__(
        self,
        stages: Mapping[int, Stage],
        last: int,
        params: Params,
        buffers: Buffers,
        microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
        wait: Callable[[Any], Any],
        runner: StageRunner,
    ) -> None:
        self.stages, self.last, self.params, self.buffers = stages, last, params, buffers
        self.microbatches, self.wait, self.runner = microbatches, wait, runner
        self.inputs: dict[tuple[int, int], Any] = {}
        self.output_grads: dict[tuple[int, int], Any] = {}  # a forward-only row never sends gradients
        self.outputs: dict[int, dict[str, Any]] = {}

    def run(self, action: Action) -> None:
        s, i = action.stage, action.microbatch
        inputs, kwargs, _ = self.microbatches[i]
        inputs = inputs if s == 0 else self.wait(self.inputs.pop((s, i)))
        trainable, frozen, stage_buffers = stage_args(self.stages[s], self.params, self.buffers)
        outputs = self.runner.forward(self.stages[s], {**trainable, **frozen}, stage_buffers, inputs, kwargs)
        if s == self.last:
            self.outputs[i] = outputs
        else:
            self.inputs[(s + 1, i)] = outputs


def _forwards_only(program: Program) -> Program:
    """``program`` with its compute actions other than ``F`` removed (an inference program stays as it is).

    Each rank keeps its forwards in their order; dropping actions removes only dependencies, so the result is
    as deadlock-free as ``program``.
    """
    ranks = tuple(tuple(a for a in row if a.kind == "F") for row in program.compute_only().ranks)
    return dataclasses.replace(program, ranks=ranks)


def run_rank_forward(
    pipeline: PipelineRank,
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    *,
    step: torch.Tensor | None = None,
    runner: StageRunner | None = None,
    trace: list[tuple[Action, float, float]] | None = None,
) -> list[dict[str, Any]]:
    """Run the forwards of this rank's row, without gradients, with sends and receives (eval and inference).

    Any program works (a training program's backwards are skipped: :func:`forwards_only`); every rank of the
    ``pp`` group calls it with the same microbatches. Buffer updates are discarded, as
    :func:`~d9dfn.pipeline.run_forward` discards them.

    Args:
        pipeline, params, buffers, microbatches, step, runner, trace: as :func:`run_rank_program` (buffer updates
            are discarded).

    Returns:
        On the rank that holds the last stage, its outputs per microbatch in microbatch order; ``[]`` elsewhere.

    Raises:
        ValueError: a microbatch count other than the program's, or a local stage's param that ``params`` and
            ``buffers`` lack.
        RuntimeError: a send or receive failed or timed out, naming the action and the peer.
    """
    program = pipeline.program
    if len(microbatches) != program.num_microbatches:
        raise ValueError(
            f"run_rank_forward: {len(microbatches)} microbatches for a program of {program.num_microbatches}; "
            "split the batch into the program's count"
        )
    local = _check_local_params("run_rank_forward", pipeline, params, buffers)
    trace = pipeline.trace if trace is None else trace
    stages = _runner(runner, None)
    channel = _channel("run_rank_forward", pipeline, params, microbatches, step, trace, stages.call)
    last = program.num_stages - 1
    forwards = _Forwards(local, last, params, buffers, microbatches, channel.wait, stages)
    with torch.no_grad():
        channel.run(lower(_forwards_only(program)).ranks[pipeline.rank], forwards)
    if last not in local:
        return []
    return [forwards.outputs[i] for i in range(program.num_microbatches)]
