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

Each message has its own tag (stage, microbatch, direction, tensor), so matching never depends on the order in
which the backend delivers. P2P stays outside compiled graphs (torch 2.13 has no functional send/recv): the
pieces may be compiled, the program is interpreted. A failed or timed-out send/receive raises a
``RuntimeError`` that names this rank, the action, the microbatch, the peer and the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from d9dfn._types import Buffers, Params
from d9dfn.pipeline._executor import LossFn, ProgramResult, _check_stages, _check_training, _Interpreter
from d9dfn.pipeline._lower import lower
from d9dfn.pipeline._program import Action, Program
from d9dfn.pipeline._split_backward import SplitBackward
from d9dfn.pipeline._stage import Stage, stage_io_shapes

__all__ = ["PipelineRank", "run_rank_program"]


@dataclasses.dataclass(frozen=True)
class PipelineRank:
    """What one pipeline rank runs: a program's row, the stages it holds, and the ``pp`` group to talk over.

    Pass it as ``make_train_step(pipeline=...)``; the step then runs :func:`run_rank_program` and reduces the
    loss, the loss weight and the gradient norm over ``group`` (``d9dfn.parallel.pipeline_reduction``).

    Attributes:
        program: the compute program (lowered here); ``program.ranks[rank]`` is this rank's row.
        stages: every stage's skeleton (meta, cheap), in stage order: the boundary shapes come from them and
            the whole model's param order for the global norm. Only this rank's stages ever see real tensors.
        rank: this rank's position in ``group`` (``d9dfn.parallel.pipeline_rank(mesh)``).
        group: the ``pp`` process group (``d9dfn.parallel.pipeline_group(mesh)``).
    """

    program: Program
    stages: tuple[Stage, ...]
    rank: int
    group: Any

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
    stages: Sequence[Stage], microbatch: tuple[dict[str, Any], dict[str, Any], Any]
) -> tuple[dict[str, torch.Tensor], ...]:
    inputs, kwargs, _ = microbatch
    rows = next((v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim > 0), 1)
    return stage_io_shapes(stages, inputs, kwargs, microbatch_size=rows)


def run_rank_program(
    pipeline: PipelineRank,
    params: Params,
    buffers: Buffers,
    microbatches: Sequence[tuple[dict[str, Any], dict[str, Any], Any]],
    loss: LossFn,
    *,
    sums: tuple[Params, torch.Tensor, torch.Tensor] | None = None,
    step: torch.Tensor | None = None,
    split: SplitBackward | None = None,
) -> ProgramResult:
    """Run this rank's row of a training program; every rank of the ``pp`` group calls it with the same batch.

    Args:
        pipeline: the program, the stages and this rank's place (:class:`PipelineRank`).
        params: this rank's trainable params (its stages' only; plain tensors), full names.
        buffers: this rank's buffers and frozen params.
        microbatches: per microbatch ``(inputs, kwargs, state)``, the same on every pipeline rank (each runs the
            task's ``build_forward_inputs`` on the batch: cheap, no broadcast).
        loss: as :func:`~d9dfn.pipeline.run_program`; called on the last stage's rank only.
        sums: where to start accumulating; ``None``: zeros.
        step: the step, named in a communication error (read only then).

    Returns:
        The local sums (``Σwℓ = Σw = 0`` without the last stage; the tail sums them over ``pp``), this rank's
        buffers, and the losses' ``aux`` per microbatch (empty without the last stage).

    Raises:
        ValueError: a forward-only program, or a local stage's param that ``params`` and ``buffers`` lack
            (e.g. a weight tied to another stage's).
        RuntimeError: a send or receive failed or timed out (a peer died), naming the action and the peer.
    """
    import torch.distributed as dist

    program, rank, group = pipeline.program, pipeline.rank, pipeline.group
    _check_training("run_rank_program", program, microbatches)
    local = {s.index: s for s in pipeline.local_stages}
    for stage in local.values():
        missing = sorted(stage.param_names - params.keys() - buffers.keys())
        if missing:
            raise ValueError(
                f"run_rank_program: stage {stage.index}'s param {missing[0]!r} is in neither params nor buffers; a "
                "weight tied across stages (e.g. the embedding and the LM head) is not supported: untie it "
                "(tie_word_embeddings=False) or keep both uses on one stage; otherwise pass this rank's params"
            )
    shapes = _io_shapes(pipeline.stages, microbatches[0])
    device = next(iter(params.values())).device if params else torch.device("cpu")
    sends: list[tuple[Any, Action, int, Any]] = []

    def fail(action: Action, peer: int, error: BaseException) -> RuntimeError:
        at = "" if step is None else f" at step {int(step)}"
        return RuntimeError(
            f"run_rank_program: pipeline rank {rank}{at}: {action} (microbatch {action.microbatch}) with pipeline "
            f"rank {peer} failed ({type(error).__name__}: {error}); that rank died or did not answer within the "
            "process group's timeout: check its log, then rerun (resume from the last checkpoint)"
        )

    def global_rank(peer: int) -> int:
        return int(dist.get_global_rank(group, peer))

    def wait(value: Any) -> Any:
        if not isinstance(value, _Pending):
            return value
        for work in value.works:
            try:
                work.wait()
            except Exception as error:  # gloo: RuntimeError on a closed pair or a timeout
                raise fail(value.action, value.peer, error) from error
        return value.value

    interpreter = _Interpreter(program, local, params, buffers, microbatches, loss, sums, wait=wait, split=split)
    peer_stage = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}
    for action in lower(program).ranks[rank]:
        if action.is_compute:
            interpreter.run(action)
            continue
        s, i = action.stage, action.microbatch
        peer = program.stage_to_rank[s + peer_stage[action.kind]]
        try:
            if action.kind == "SEND_F":  # activations of stage s for stage s + 1
                value = interpreter.inputs.pop((s + 1, i))
                for j, name in enumerate(_tensor_names(shapes[s], floats_only=False)):
                    tensor = value[name].detach().contiguous()
                    tag = _tag(program, s, i, False, j)
                    sends.append((dist.isend(tensor, global_rank(peer), group=group, tag=tag), action, peer, tensor))
            elif action.kind == "SEND_B":  # gradients of stage s - 1's outputs
                value = interpreter.output_grads.pop((s - 1, i))
                for j, name in enumerate(_tensor_names(shapes[s - 1], floats_only=True)):
                    grad = value.get(name)
                    tensor = (torch.zeros_like(shapes[s - 1][name], device=device) if grad is None else grad).detach()
                    tensor = tensor.contiguous()
                    tag = _tag(program, s, i, True, j)
                    sends.append((dist.isend(tensor, global_rank(peer), group=group, tag=tag), action, peer, tensor))
            else:
                forward = action.kind == "RECV_F"
                spec = shapes[s - 1] if forward else shapes[s]  # what the sender's stage outputs
                received: dict[str, Any] = dict(spec) if forward else {}  # non-tensor outputs are static
                works = []
                for j, name in enumerate(_tensor_names(spec, floats_only=not forward)):
                    buffer = torch.empty_like(spec[name], device=device)
                    tag = _tag(program, s - 1 if forward else s + 1, i, not forward, j)
                    works.append(dist.irecv(buffer, global_rank(peer), group=group, tag=tag))
                    received[name] = buffer
                mailbox = interpreter.inputs if forward else interpreter.output_grads
                mailbox[(s, i)] = _Pending(received, works, action, peer)
        except Exception as error:
            if isinstance(error, RuntimeError) and str(error).startswith("run_rank_program"):
                raise
            raise fail(action, peer, error) from error
    for work, action, peer, _ in sends:  # drain: every send's buffer stays alive until here
        try:
            work.wait()
        except Exception as error:
            raise fail(action, peer, error) from error
    return interpreter.result()
