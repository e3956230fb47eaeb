"""d9d's SFT task, d9dfn-style: padding and -100 labels, a token-weighted loss, 50 compiled steps."""

import torch
import torch.nn.functional as F

import d9dfn
from d9dfn import optim
from d9dfn.models import Qwen3Config, Qwen3LM


class SFTTask(d9dfn.TrainTask):
    def build_forward_inputs(self, batch, state):
        state = state.set("labels", batch["labels"])  # read back per microbatch in compute_loss
        return d9dfn.BuildForwardInputsResult(inputs={"input_ids": batch["input_ids"]}), state

    def compute_loss(self, outputs, state, step):
        labels = state["labels"]  # (B, T); -100 marks prompt and padding
        num_tokens = (labels != -100).sum()
        nll = F.cross_entropy(outputs["logits"].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        # Weighted by token count: the step's gradient is the mean over every answer token of the batch.
        return d9dfn.ComputeLossResult(loss=nll / num_tokens.clamp(min=1), loss_weight=num_tokens.float())


def sft_batch(batch_size=8, prompt=12, answer=12, pad=8):
    """Prompt, then its reverse as the answer, then padding; only the answer carries loss."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 256, (batch_size, prompt), generator=gen)
    tokens = torch.cat([prompts, prompts.flip(1)[:, :answer], torch.zeros(batch_size, pad, dtype=torch.long)], 1)
    labels = tokens[:, 1:].clone()
    labels[:, : prompt - 1] = -100
    labels[:, prompt - 1 + answer :] = -100
    return {"input_ids": tokens[:, :-1], "labels": labels}


torch.manual_seed(0)
model = Qwen3LM(Qwen3Config.tiny())
opt = optim.adamw(3e-3)
state = d9dfn.init_train_state(model, opt)
step = d9dfn.make_train_step(model, SFTTask(), opt, num_microbatches=2, max_grad_norm=1.0)  # torch.compile'd
batch = sft_batch()
for i in range(50):
    state, out = step(state, batch)
    if i % 10 == 0 or i == 49:
        print(f"step {i + 1:2d}  loss {float(out.loss):.3f}")
