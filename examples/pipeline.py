"""A pipeline program on one process: Qwen3 cut into 2 stages, 1F1B over 4 microbatches.

The single-process reference executor runs the program's actions in a dependency order; its result is
bitwise the unpipelined step's (every schedule emits each stage's backwards in increasing microbatch order).
"""

import torch

from d9dfn import init_train_state, make_train_step, optim, pipeline
from d9dfn.models import Qwen3Config, Qwen3LM
from d9dfn.tasks import CausalLMTask

torch.manual_seed(0)
config = Qwen3Config.tiny(tie_word_embeddings=False)  # a weight on two stages is refused
model = Qwen3LM(config)
stages = pipeline.build_stages(lambda info: Qwen3LM(config, stage=info, last_stage_cost=0), num_stages=2)
program = pipeline.one_f_one_b(num_ranks=2, stages_per_rank=1, num_microbatches=4)
print(pipeline.render(program))

opt = optim.adamw(1e-3)
state = init_train_state(model, opt)
tokens = torch.randint(0, config.vocab_size, (8, 33))
batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
plain = make_train_step(model, CausalLMTask(), opt, num_microbatches=4, compile=False)
piped = make_train_step(model, CausalLMTask(), opt, executor=pipeline.Pipeline(program, stages), compile=False)
(plain_state, plain_out), (piped_state, piped_out) = plain(state, batch), piped(state, batch)
same = all(torch.equal(plain_state.params[name], piped_state.params[name]) for name in plain_state.params)
print(f"loss {float(piped_out.loss):.4f}; params bitwise equal to the unpipelined step: {same}")
