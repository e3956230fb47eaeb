"""Models as a catalogue: model families by name (:data:`FAMILIES`, ``model.family`` in a job), each in a folder of its
own, and the shared decoder four of them configure.

- ``qwen3/``, ``llama/``, ``mistral/``, ``qwen2/``: one folder per family, holding its :class:`Family` (config
  builder, model, Hugging Face conventions and tensor-name mapping, plan). These four are configurations of one
  shared decoder and hold only their Hugging Face conventions; a family with a model of its own (an MoE decoder)
  keeps its model, config, mapping and plan in its folder.
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

Heads go beside the families, not inside them: today the LM head is part of the shared decoder (tied to the
embedding or not, on the last pipeline stage); a classification or embedding head on any family's final hidden
states (Hugging Face's ``*ForSequenceClassification``) would be a module of its own here (``_heads.py``), its
tensor names mapped with the family's, and the task that reads its outputs lives in ``d9dfn.tasks`` beside
``CausalLMTask``.
"""

from d9dfn.models._decoder import Qwen3LM, document_mask
from d9dfn.models._decoder_config import Qwen3Config, flops_per_token, num_parameters
from d9dfn.models._family import Family, HFFamily, Plan, logical_dims
from d9dfn.models._hf import HF_FIELDS, check_hf_config, from_hf_config, to_hf_config
from d9dfn.models._hf_state import from_hf_state, to_hf_state
from d9dfn.models._layers import RopeScaling
from d9dfn.models._lora import (
    FullTune,
    LoRA,
    LoRALinear,
    PeftMethod,
    apply_peft,
    check_targets,
    lora_modules,
    merge_lora,
    peft_trainable,
    target_names,
)
from d9dfn.models._registry import FAMILIES, HF_FAMILIES

__all__ = [
    "FAMILIES",
    "HF_FAMILIES",
    "HF_FIELDS",
    "Family",
    "FullTune",
    "HFFamily",
    "LoRA",
    "LoRALinear",
    "PeftMethod",
    "Plan",
    "Qwen3Config",
    "Qwen3LM",
    "RopeScaling",
    "apply_peft",
    "check_hf_config",
    "check_targets",
    "document_mask",
    "flops_per_token",
    "from_hf_config",
    "from_hf_state",
    "logical_dims",
    "lora_modules",
    "merge_lora",
    "num_parameters",
    "peft_trainable",
    "target_names",
    "to_hf_config",
    "to_hf_state",
]
