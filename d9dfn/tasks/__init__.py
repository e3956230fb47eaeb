"""Ready-made tasks: next-token language modelling (training) and perplexity (inference)."""

from d9dfn.tasks._causal_lm import IGNORE_INDEX, CausalLMTask, PerplexityTask, token_nll

__all__ = ["IGNORE_INDEX", "CausalLMTask", "PerplexityTask", "token_nll"]
