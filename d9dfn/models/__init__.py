"""Models as a catalogue: model families by name (:data:`FAMILIES`, ``model.family`` in a job), each in a folder of its
own, and the shared decoder four of them configure.

- ``qwen3/``, ``llama/``, ``mistral/``, ``qwen2/``, ``qwen3_moe/``: one folder per family, holding its :class:`Family`
  (config builder, model, Hugging Face conventions and tensor-name mapping, plan). The first four are configurations
  of one shared decoder and hold only their Hugging Face conventions; ``qwen3_moe`` has a model of its own
  (:class:`Qwen3MoeLM`: the shared decoder with mixture-of-experts MLPs, the MoE block as pure functions in
  ``qwen3_moe/_moe.py``) and keeps its model, config, mapping (both expert layouts) and plan in its folder.
- ``_registry.py``: :data:`FAMILIES`, the one table the job, :func:`from_hf_config`, :func:`to_hf_config` and
  ``d9dfn export --format hf`` look families up in; adding a family is its folder and its entry there.
- ``_decoder.py``, ``_decoder_config.py``, ``_layers.py``: the shared decoder (:class:`Qwen3LM`, a small Qwen3-dense
  style decoder-only LM for examples, tests and benchmarks; its switches make it Llama, Mistral or Qwen2), its
  sizes (:class:`Qwen3Config`) and building blocks; ``_hf.py``, ``_hf_state.py``: its ``config.json`` fields and
  tensor names against Hugging Face's ``*ForCausalLM`` folders of those families.
- ``_lora.py``: parameter-efficient fine-tuning as a transform of a model (LoRA adapters, full tuning by pattern,
  stacked; the trainable predicate; adapters merged into their base).
- ``_family.py``: the catalogue's vocabulary (:class:`Family`, :class:`HFFamily`, :data:`Plan`,
  :func:`logical_dims`).

Heads go beside the families, not inside them: the LM head is part of the shared decoder (tied to the embedding or
not, on the last pipeline stage); a classification or embedding head sits on any family's backbone (``Family.backbone``:
its model without the LM head) in ``_heads.py`` (:class:`SequenceClassifier`, :class:`SequenceEmbedder`, :func:`pool`),
its tensor names and ``config.json`` mapped to Hugging Face's ``*ForSequenceClassification`` through the family's own
mapping in ``_heads_hf.py``; the task that reads its outputs is ``d9dfn.tasks.ClassificationTask``.
"""

from d9dfn.models._decoder import (
    Qwen3LM,
    bind_context_parallel,
    bind_tensor_parallel,
    check_tensor_parallel,
    document_mask,
)
from d9dfn.models._decoder_config import Qwen3Config, flops_per_token, num_parameters
from d9dfn.models._family import Family, HFFamily, Plan, logical_dims, summed_dims
from d9dfn.models._heads import (
    POOLINGS,
    Pooling,
    SequenceClassifier,
    SequenceEmbedder,
    classifier_plan,
    embedder_plan,
    pool,
)
from d9dfn.models._heads_hf import (
    classifier_architecture,
    classifier_from_hf_state,
    classifier_to_hf_state,
    from_hf_classifier_config,
    to_hf_classifier_config,
)
from d9dfn.models._hf import HF_FIELDS, check_hf_config, from_hf_config, to_hf_config
from d9dfn.models._hf_state import from_hf_state, to_hf_state
from d9dfn.models._layers import RopeScaling
from d9dfn.models._lora import (
    FullTune,
    LoRA,
    LoRALinear,
    PeftMethod,
    adapter_plan,
    apply_peft,
    check_targets,
    lora_modules,
    merge_lora,
    peft_trainable,
    target_names,
)
from d9dfn.models._registry import FAMILIES, HF_FAMILIES
from d9dfn.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeLM

__all__ = [
    "FAMILIES",
    "HF_FAMILIES",
    "HF_FIELDS",
    "POOLINGS",
    "Family",
    "FullTune",
    "HFFamily",
    "LoRA",
    "LoRALinear",
    "PeftMethod",
    "Plan",
    "Pooling",
    "Qwen3Config",
    "Qwen3LM",
    "Qwen3MoeConfig",
    "Qwen3MoeLM",
    "RopeScaling",
    "adapter_plan",
    "apply_peft",
    "bind_context_parallel",
    "bind_tensor_parallel",
    "check_tensor_parallel",
    "check_hf_config",
    "check_targets",
    "SequenceClassifier",
    "SequenceEmbedder",
    "classifier_architecture",
    "classifier_from_hf_state",
    "classifier_plan",
    "classifier_to_hf_state",
    "document_mask",
    "embedder_plan",
    "flops_per_token",
    "from_hf_classifier_config",
    "from_hf_config",
    "from_hf_state",
    "logical_dims",
    "lora_modules",
    "merge_lora",
    "num_parameters",
    "peft_trainable",
    "target_names",
    "pool",
    "summed_dims",
    "to_hf_classifier_config",
    "to_hf_config",
    "to_hf_state",
]
