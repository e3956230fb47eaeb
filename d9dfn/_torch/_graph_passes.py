"""How d9dfn hands a graph pass to torch's compilers: as inductor's post-grad pass, or on the partitioned forward and
backward graphs of ``aot_eager`` (``d9dfn/parallel/_prefetch.py``'s prefetch of the per-block all-gathers).

The row ``prefetch_pass_hooks`` of the torch-patch table (``d9dfn/_torch/_table.py``): required by
``prefetch_gathers=True`` (no switch: it is what that option means).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

__all__ = ["aot_eager_with", "capable", "post_grad_pass"]


def post_grad_pass(rewrite: Callable[[torch.fx.Graph], Any], files: Sequence[str]) -> Any:
    """``rewrite`` as inductor's post-grad pass (``options={"post_grad_custom_post_pass": ...}``): an object whose
    ``uuid`` (part of inductor's cache key) is the hash of ``files``, the source files that define ``rewrite``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class GraphPass(CustomGraphPass):
        """``rewrite`` as inductor's post-grad pass, keyed on ``files``."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            rewrite(graph)

        def uuid(self) -> bytes:
            return get_hash_for_files(tuple(files))

    return GraphPass()


def aot_eager_with(rewrite: Callable[[torch.fx.GraphModule], torch.fx.GraphModule]) -> Callable[..., Any]:
    """A ``torch.compile`` backend: ``aot_eager`` with ``rewrite`` applied to the partitioned forward and backward
    graphs."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return make_boxed_func(rewrite(gm).forward)

    return functools.partial(aot_eager, fw_compiler=compiler, bw_compiler=compiler)


def capable() -> bool:
    """The capability check of ``prefetch_pass_hooks``: the pass class, the option and the backend exist."""
    try:
        from torch._dynamo.backends.debugging import aot_eager  # noqa: F401
        from torch._functorch.aot_autograd import make_boxed_func  # noqa: F401
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: F401
    except ImportError:
        return False
    return hasattr(config, "post_grad_custom_post_pass")
