"""Settings whose effect no other test observed through the config (docs/design/settings.md, issue 11 item 3).

Each test sets the field and observes what it changes: a sample's length and sharpness, the collective timeout
handed to the process group, the inference step's microbatch count and its compilation.
"""

from __future__ import annotations

import pytest
import torch

import d9dfn.loop._inference as inference_module
import d9dfn.loop._train as train_module
from d9dfn.config import DeviceMeshParameters, InferenceConfig, load_config
from d9dfn.jobs import LMJobConfig, SampleConfig, decode_bytes
from d9dfn.jobs._lm import generate
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.testing import assert_trees_close


def _model() -> tuple[Qwen3LM, dict, dict]:
    torch.manual_seed(0)
    model = Qwen3LM(Qwen3Config.tiny(vocab_size=256))
    return model, dict(model.named_parameters()), dict(model.named_buffers())


def test_sample_num_bytes_sets_the_sample_length_and_temperature_its_sharpness():
    model, params, buffers = _model()
    # The greedy continuation, byte by byte: a near-zero temperature must reproduce it exactly.
    ids = list(b"ab")
    with torch.no_grad():
        for _ in range(8):
            logits = torch.func.functional_call(model, (params, buffers), (torch.tensor([ids]),))["logits"][0, -1]
            ids.append(int(logits.argmax()))
    for num_bytes in (0, 3, 8):
        sample = generate(
            model, params, buffers, SampleConfig(prompt="ab", num_bytes=num_bytes, temperature=1e-4), seq_len=16
        )
        assert sample == decode_bytes(ids[: 2 + num_bytes])
    hot = generate(model, params, buffers, SampleConfig(prompt="ab", num_bytes=8, temperature=50.0), seq_len=16)
    assert hot != decode_bytes(ids)  # a flat distribution does not follow the argmax


def test_timeout_init_timeout_is_the_process_group_timeout_at_start_up(tmp_path, monkeypatch):
    seen = {}

    def fake_init_distributed(mesh, *, timeout_s, device_type=None):
        seen["timeout_s"] = timeout_s
        raise RuntimeError("stop here: the timeout was observed")

    monkeypatch.setattr(train_module, "init_distributed", fake_init_distributed)
    job = load_config(
        LMJobConfig,
        None,
        [f"trainer.checkpointing.save_dir={tmp_path}", "trainer.timeout.init_timeout=1234"],
        default=LMJobConfig(),
    )
    from d9dfn.jobs import CorpusProvider, Qwen3Provider
    from d9dfn.loop import TrainingConfigurator
    from d9dfn.tasks import CausalLMTask

    configurator = TrainingConfigurator(
        mesh=DeviceMeshParameters(data_parallel_replicate=2),
        parameters=job.trainer,
        task_provider=CausalLMTask,
        model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
        data_provider=CorpusProvider(job.data),
    )
    with pytest.raises(RuntimeError, match="stop here"):
        configurator.configure()
    assert seen["timeout_s"] == 1234


@pytest.mark.parametrize(("compile", "microbatch_size", "expected_microbatches"), [(False, 2, 4), (True, 4, 2)])
def test_inference_batching_microbatch_size_and_compile_reach_the_inference_step(
    monkeypatch, compile, microbatch_size, expected_microbatches
):
    calls = []
    real = inference_module.make_inference_step

    def spy(model, task, **options):
        calls.append(options)
        return real(model, task, **options)

    monkeypatch.setattr(inference_module, "make_inference_step", spy)
    config = InferenceConfig(
        batching={"global_batch_size": 8, "microbatch_size": microbatch_size}, checkpointing=None, compile=compile
    )
    model, params, buffers = _model()
    from d9dfn.tasks import PerplexityTask

    inference_module.Inference(
        config=config,
        task=PerplexityTask(),
        skeleton=model,
        params=params,
        buffers=buffers,
        checkpoint_step=None,
        data=None,
        bus=None,
        max_batches=None,
    )
    assert calls[0]["num_microbatches"] == expected_microbatches
    assert all(call["compile"] is compile for call in calls)
    assert_trees_close(params, dict(model.named_parameters()))
