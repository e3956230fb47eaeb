"""The device mesh's degrees (d9d's ``DeviceMeshParameters``) and the batch arithmetic they imply."""

from __future__ import annotations

from typing import NamedTuple

from pydantic import PositiveInt, model_validator

from d9dfn.config._base import FrozenConfig as _Config

__all__ = ["BatchMaths", "DeviceMeshParameters", "batch_maths"]


class DeviceMeshParameters(_Config):
    """Degrees of parallelism; their product (without ``expert_parallel``) is the number of processes."""

    pipeline_parallel: PositiveInt = 1
    """Pipeline stages."""
    data_parallel_replicate: PositiveInt = 1
    """Data-parallel replicas that each hold a full copy of the params (DDP)."""
    data_parallel_shard: PositiveInt = 1
    """Data-parallel ranks that shard params, grads and optimizer states (FSDP)."""
    context_parallel_replicate: PositiveInt = 1
    """Context-parallel ranks with replicated params."""
    context_parallel_shard: PositiveInt = 1
    """Context-parallel ranks with sharded params."""
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel ranks: each computes ``1/tensor_parallel`` of every block's attention heads, kv-heads and MLP
    width, on the same rows (it must divide them)."""
    sequence_parallel: bool = False
    """With ``tensor_parallel > 1``: the blocks' norms and residual stream split over the sequence between the blocks
    (an all-gather and a reduce-scatter per attention and MLP in place of two all-reduces); ``tensor_parallel`` must
    divide ``data.seq_len``."""
    vocab_parallel: bool = True
    """With ``tensor_parallel > 1``: the embedding and the LM head split over the tensor-parallel ranks by vocabulary
    rows, and the loss computed on the split logits, never gathered (``d9dfn.parallel.VOCAB_PARALLEL_RULES``; the
    model's vocabulary size must divide by ``tensor_parallel``). ``false``: both computed whole on every rank (each
    rank then holds the whole ``(B, T, V)`` logits). No effect without tensor parallelism."""
    expert_parallel: PositiveInt = 1
    """Expert-parallel ranks, carved out of the data-parallel ranks: out of ``data_parallel_shard`` when it divides it
    (params other than the experts then sharded over them too, FSDP), else out of ``data_parallel_replicate`` (those
    params whole on them); each holds ``num_experts / expert_parallel`` experts. Alone (every other degree 1) in the LM
    job, the data-parallel degree is the number of processes ``torchrun`` started."""

    @model_validator(mode="after")
    def _sequence_needs_tensor(self) -> DeviceMeshParameters:
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "mesh.sequence_parallel=true splits the sequence over the tensor-parallel ranks, but "
                "mesh.tensor_parallel=1; set --set mesh.tensor_parallel to 2 or more, or mesh.sequence_parallel=false"
            )
        return self

    @model_validator(mode="after")
    def _experts_divide(self) -> DeviceMeshParameters:
        non_pipeline = self.world_size // self.pipeline_parallel
        if non_pipeline == 1:
            return (
                self  # only expert_parallel given: the data-parallel degree comes from torchrun (the LM job's mesh_of)
            )
        if non_pipeline % self.expert_parallel:
            raise ValueError(
                f"mesh.expert_parallel={self.expert_parallel} does not divide data_parallel_replicate * "
                f"data_parallel_shard * context_parallel_replicate * context_parallel_shard * tensor_parallel = "
                f"{non_pipeline}; choose one that divides {non_pipeline} (--set mesh.expert_parallel=...)"
            )
        return self

    @property
    def world_size(self) -> int:
        """The number of processes the mesh needs.

        >>> DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=4).world_size
        8
        """
        return (
            self.pipeline_parallel
            * self.data_parallel_replicate
            * self.data_parallel_shard
            * self.context_parallel_replicate
            * self.context_parallel_shard
            * self.tensor_parallel
        )

    @property
    def data_parallel_size(self) -> int:
        """The number of ranks that see different samples (replicate x shard)."""
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def is_distributed(self) -> bool:
        """Whether the job needs more than one process."""
        return self.world_size > 1


class BatchMaths(NamedTuple):
    """How one optimizer step's samples are split across ranks and microbatches."""

    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""
    microbatch_size: int
    """Samples per forward/backward pass on one rank."""
    data_parallel_size: int
    """Ranks that see different samples."""
    per_rank_batch_size: int
    """Samples per optimizer step on one rank: ``microbatch_size * num_microbatches``."""
    num_microbatches: int
    """Microbatches per rank per step: ``global_batch_size / (data_parallel_size * microbatch_size)``, whether the
    step's executor runs them in sequence (accumulating gradients) or through a pipeline schedule (d9d counts
    these two cases apart)."""


def batch_maths(
    *, global_batch_size: int, microbatch_size: int, data_parallel_size: int = 1, section: str = "batching"
) -> BatchMaths:
    """Derive per-rank batch size and microbatch count from the batching config and the data-parallel size.

    Args:
        global_batch_size: samples per optimizer step over all ranks.
        microbatch_size: samples per forward/backward pass on one rank.
        data_parallel_size: ranks that see different samples (``DeviceMeshParameters.data_parallel_size``).
        section: where the two sizes are set, for the message (``trainer.batching`` in a job).

    Raises:
        ValueError: a size below 1, or ``global_batch_size`` not a multiple of ``data_parallel_size *
            microbatch_size``.

    >>> batch_maths(global_batch_size=32, microbatch_size=4, data_parallel_size=2).num_microbatches
    4
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("microbatch_size", microbatch_size),
        ("data_parallel_size", data_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batch_maths: {name}={value!r} must be an int >= 1")
    samples_per_pass = data_parallel_size * microbatch_size
    if global_batch_size % samples_per_pass:
        raise ValueError(
            f"batch_maths: {section}.global_batch_size={global_batch_size} is not a multiple of data_parallel_size="
            f"{data_parallel_size} x {section}.microbatch_size={microbatch_size} = {samples_per_pass}; set "
            f"{section}.global_batch_size to a multiple of {samples_per_pass} (--set {section}.global_batch_size="
            f"{(global_batch_size // samples_per_pass + 1) * samples_per_pass}) or reduce {section}.microbatch_size"
        )
    return BatchMaths(
        global_batch_size=global_batch_size,
        microbatch_size=microbatch_size,
        data_parallel_size=data_parallel_size,
        per_rank_batch_size=global_batch_size // data_parallel_size,
        num_microbatches=global_batch_size // samples_per_pass,
    )
