"""d9d's ``calculate_perplexity`` example, the d9dfn way: an ``InferenceTask`` over a training run.

Run after ``d9dfn train examples/pretrain.json``:  ``python examples/perplexity.py examples/pretrain.json``
(``d9dfn infer CONFIG`` does the same and also prints a sample).
"""

import sys
from pathlib import Path

from d9dfn.config import DeviceMeshParameters, InferenceCheckpointingConfig, InferenceConfig, load_config
from d9dfn.jobs import CorpusProvider, LMJobConfig, Qwen3Provider, run_dir_of
from d9dfn.loop import InferenceConfigurator
from d9dfn.tasks import PerplexityTask

job = load_config(LMJobConfig, Path(sys.argv[1]) if len(sys.argv) > 1 else None, sys.argv[2:])
inference = InferenceConfigurator(
    mesh=DeviceMeshParameters(),
    # The run's shared sections (batching, precision, compile, ...) as it trained; its checkpoint's weights.
    parameters=InferenceConfig.from_trainer(
        job.trainer, checkpointing=InferenceCheckpointingConfig(load_dir=run_dir_of(job))
    ),
    task_provider=PerplexityTask,  # sums token NLL and counts; finalize() returns exp(mean NLL)
    model_provider=Qwen3Provider(job.model.to_qwen3(job.data.seq_len)),
    data_provider=CorpusProvider(job.data),
    split="validation",
).configure()
result = inference.infer()
print(f"checkpoint step {result.checkpoint_step}: {result.task_result}")
