"""Reference models: a small Qwen3-dense style decoder-only LM for examples, tests and benchmarks."""

from d9dfn.models._qwen3 import Qwen3Config, Qwen3LM, flops_per_token, num_parameters

__all__ = ["Qwen3Config", "Qwen3LM", "flops_per_token", "num_parameters"]
