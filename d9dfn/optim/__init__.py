"""Optimizers as pure transforms: ``update(grads, state, params) -> (updates, state)``, then ``apply_updates``.

Factories (``adamw(lr=...)``) return a :class:`~d9dfn.Transform`; their state is a NamedTuple named
after them, with a 0-d ``count``. ``lr`` is a float or a :class:`~d9dfn.schedules` schedule evaluated
at that count; the state records the rate each update used (0-d ``lr``), which :func:`learning_rate` reads.
Everything here is safe to compile whole with ``torch.compile(fullgraph=True)``.

>>> import torch
>>> from d9dfn import optim
>>> params = {"w": torch.tensor([1.0, -1.0])}
>>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1, weight_decay=0.0))
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": torch.tensor([0.5, -0.5])}, state, params)
>>> optim.apply_updates(params, updates)
{'w': tensor([ 0.9000, -0.9000])}
"""

from d9dfn._types import Transform
from d9dfn.optim._adam import AdamState, AdamWState, adam, adamw
from d9dfn.optim._base import LearningRate, learning_rate
from d9dfn.optim._clip import ClipByGlobalNormState, clip_by_global_norm, clip_factor, global_norm
from d9dfn.optim._combine import MaskedState, apply_updates, chain, masked
from d9dfn.optim._sgd import SGDState, sgd
from d9dfn.optim._stochastic import StochasticAdamWState, stochastic_adamw, stochastic_round

__all__ = [
    "AdamState",
    "AdamWState",
    "ClipByGlobalNormState",
    "LearningRate",
    "MaskedState",
    "SGDState",
    "StochasticAdamWState",
    "Transform",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "clip_factor",
    "global_norm",
    "learning_rate",
    "masked",
    "sgd",
    "stochastic_adamw",
    "stochastic_round",
]
