"""Sampling from the job's model: token by token (bytes, or a ``model.source`` tokenizer's ids) on one process, or
through the pipeline's ranks.

Sampling needs the whole distribution of the next token: a model bound with vocabulary parallelism returns this rank's
columns (``d9dfn.parallel.VocabParallelLogits``), of which :func:`next_logits` gathers the last position's only
(``d9dfn.parallel.whole_logits``: ``V`` values per new token, never the ``(1, T, V)``)."""

from __future__ import annotations

from typing import Any

import torch

from d9dfn import BuildForwardInputsResult, InferenceState, InferenceTask, PipelineState, make_inference_step
from d9dfn.data import ByteTokenizer, Tokenizer
from d9dfn.jobs._config import SampleConfig
from d9dfn.loop import Inference
from d9dfn.parallel import VocabParallelLogits, whole_logits

__all__ = ["generate", "generate_pipelined", "next_logits"]


def next_logits(logits: torch.Tensor | VocabParallelLogits) -> torch.Tensor:
    """(1, T, V) logits of a one-row batch -> (V,) its last position's, whole: under vocabulary parallelism this
    rank's columns of that position all-gathered over the tensor group (the one gather of the logits d9dfn makes)."""
    return whole_logits(logits, (0, -1))


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    params: dict,
    buffers: dict,
    config: SampleConfig,
    *,
    seq_len: int,
    tokenizer: Tokenizer | None = None,
) -> str:
    """Sample ``config.num_bytes`` ids of ``tokenizer`` (bytes by default) after ``config.prompt``, decoded by it
    (edge code: a seeded torch generator)."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    generator = torch.Generator().manual_seed(0)
    device = next(iter(params.values())).device
    ids = list(tokenizer.encode(config.prompt))
    for _ in range(config.num_bytes):
        context = torch.tensor([ids[-seq_len:]], dtype=torch.int64, device=device)
        logits = next_logits(torch.func.functional_call(model, (params, buffers), (context,))["logits"])
        probs = torch.softmax(logits.float().cpu() / config.temperature, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokenizer.decode(ids)


class _NextByteLogits(InferenceTask[dict[str, torch.Tensor]]):
    """The sampler's task: the last position's logits of a one-row batch become the task state."""

    def build_forward_inputs(
        self, batch: dict[str, torch.Tensor], state: PipelineState
    ) -> tuple[BuildForwardInputsResult, PipelineState]:
        return BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state

    def process_outputs(self, task_state: Any, outputs: Any, state: PipelineState) -> torch.Tensor:
        return next_logits(outputs["logits"])  # (1, T, V) -> (V,)


@torch.no_grad()
def generate_pipelined(
    inference: Inference, config: SampleConfig, *, seq_len: int, tokenizer: Tokenizer | None = None
) -> str:
    """:func:`generate` through the pipeline: every rank runs its stage once per new byte; the last stage's rank
    samples (the same seeded generator, so the same bytes as one process) and broadcasts the byte over ``pp``.

    Every rank of the ``pp`` group must call it; each returns the whole sample.
    """
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    rank_pipeline = inference.one_microbatch_pipeline()
    assert rank_pipeline is not None, "generate_pipelined: the inference runs on one process; call generate"
    program, group = rank_pipeline.program, rank_pipeline.group
    sampler = program.stage_to_rank[program.num_stages - 1] == rank_pipeline.rank
    source = torch.distributed.get_global_rank(group, program.stage_to_rank[program.num_stages - 1])
    # Eager (one shape per context length) and without a precision policy, as `generate` calls the model.
    step = make_inference_step(inference.skeleton, _NextByteLogits(), executor=rank_pipeline, compile=False)
    generator = torch.Generator().manual_seed(0)
    device = next(iter(inference.params.values())).device
    state = InferenceState(
        params=inference.params,
        buffers=inference.buffers,
        step=torch.zeros((), dtype=torch.int64, device=device),
        rng=torch.zeros((), dtype=torch.int64, device=device),
    )
    ids = list(tokenizer.encode(config.prompt))
    for _ in range(config.num_bytes):
        context = torch.tensor([ids[-seq_len:]], dtype=torch.int64, device=device)
        logits = step(state, {"input_ids": context}).task_state  # None off the sampling rank
        token = torch.zeros((), dtype=torch.int64, device=device)
        if sampler:
            probs = torch.softmax(logits.float().cpu() / config.temperature, dim=-1)
            token.fill_(int(torch.multinomial(probs, 1, generator=generator)))
        torch.distributed.broadcast(token, src=source, group=group)
        ids.append(int(token))
    return tokenizer.decode(ids)
