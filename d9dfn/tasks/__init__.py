"""Ready-made tasks: next-token language modelling (training) and perplexity (inference); sequence classification."""

from d9dfn.tasks._causal_lm import IGNORE_INDEX, CausalLMTask, PerplexityTask, expert_load, token_correct, token_nll
from d9dfn.tasks._classification import ClassificationTask

__all__ = [
    "IGNORE_INDEX",
    "CausalLMTask",
    "ClassificationTask",
    "PerplexityTask",
    "expert_load",
    "token_correct",
    "token_nll",
]
