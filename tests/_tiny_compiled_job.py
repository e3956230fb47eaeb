"""A small compiled job as a process of its own (tests/test_cache_heal.py): two compiled train steps of a
two-block model on the run cache of ``RUN_DIR`` (with the host's behind it, ``D9DFN_COMPILE_CACHE``), its cache
sealed and published after the first step as the trainer does, then the parameters' bytes written to ``OUT``.

    python tests/_tiny_compiled_job.py RUN_DIR OUT
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from d9dfn import init_train_state, make_train_step, optim
from d9dfn.loop import publish_compile_cache, run_compile_cache
from d9dfn.tasks import CausalLMTask

VOCAB, SEQ, WIDTH = 16, 6, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return {"logits": self.head(x)}


def main(run_dir: str, out: str) -> None:
    run_compile_cache(run_dir)
    torch.manual_seed(0)
    model, opt = Stack(), optim.sgd(0.1, momentum=0.9)
    state = init_train_state(model, opt)
    step = make_train_step(model, CausalLMTask(), opt, repeated_blocks="auto")
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    state, _ = step(state, batch)
    publish_compile_cache()  # the trainer's seal point: the first step has loaded and run everything it compiled
    state, _ = step(state, batch)
    publish_compile_cache()
    with open(out, "wb") as file:
        for leaf in torch.utils._pytree.tree_leaves(state.params):
            file.write(leaf.detach().contiguous().numpy().tobytes())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
