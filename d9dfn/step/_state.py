"""The step's values: ``TrainState`` (what a training run carries from one step to the next, as one frozen pytree),
``InferenceState``, and what a step reports (``StepOutput``, ``EvalOutput``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from d9dfn import prng
from d9dfn._pytree import NAMESPACE, field, pytree_dataclass
from d9dfn._types import Buffers, OptState, Params, PathPredicate, PyTree, Transform

__all__ = [
    "EvalOutput",
    "InferenceState",
    "StepOutput",
    "TrainState",
    "check_live",
    "consume",
    "init_train_state",
    "frozen_names",
    "split_module_state",
    "trainable_params",
    "with_trainable",
]


@pytree_dataclass
class TrainState:
    """The whole state of a training run between two steps.

    Attributes:
        params: every parameter, trainable or frozen, flat by fully qualified name: placed, sharded and gathered
            alike (``docs/design/layout.md``) and checkpointed under ``params``.
        buffers: the module buffers (BatchNorm statistics, RoPE tables). Never mutated in place: the step returns
            new ones.
        opt_state: the optimizer transform's state; it mirrors the trainable params only
            (:func:`trainable_params`).
        step: 0-d ``int64`` count of optimizer steps taken.
        rng: 0-d key (``d9dfn.prng``); per-step and per-microbatch keys are derived from it by folding in
            the step and microbatch index, so the state itself never needs to change.
        task_state: the task's own pytree (``TrainTask.init_state``).
        metric_state: the task's metric state (``TrainTask.create_metrics().init()``).
        frozen: the names of the params the step does not train (no gradient, no optimizer state, never changed),
            in ``params``' order; decided once (``init_train_state(trainable=...)``), so it rides in the treespec
            (static): no checkpoint holds it, and a compiled step guards on it as on a constant.
    """

    params: Params
    buffers: Buffers
    opt_state: OptState
    step: torch.Tensor
    rng: torch.Tensor
    task_state: PyTree = None
    metric_state: PyTree = None
    frozen: tuple[str, ...] = field(static=True, default=())

    if TYPE_CHECKING:  # added by ``pytree_dataclass``; declared here so that type checkers know it

        def replace(self, **changes: Any) -> Self:
            """Return a copy with ``changes`` applied; the original is unchanged."""
            ...


class Donated:
    """What a donated :class:`TrainState`'s ``params`` and ``opt_state`` become once a donating train step took it
    (``make_train_step(donate=True)``): the step updated their tensors in place, so any read of them (an item, an
    iteration, a method, a flatten) raises one error naming the step and the fix.

    It keeps the state's ``step`` tensor and reads it only when it raises: marking a state costs no host sync.
    """

    __slots__ = ("field", "step")

    def __init__(self, field: str, step: torch.Tensor) -> None:
        self.field, self.step = field, step

    def error(self) -> RuntimeError:
        return RuntimeError(
            f"TrainState.{self.field} was donated to the train step at step {int(self.step)}: the step updated it in "
            "place (make_train_step(donate=True)); use the state that step returned, or build the step with "
            "donate=False to keep the state it is given"
        )

    def __getattr__(self, name: str) -> Any:  # every method of a dict or an optimizer state: .items(), .mu, ...
        if name.startswith("__"):  # Python's own probes (copy, pickle, numpy) get the usual answer
            raise AttributeError(name)
        raise self.error()

    def __getitem__(self, key: Any) -> Any:
        raise self.error()

    def __iter__(self) -> Any:
        raise self.error()

    def __len__(self) -> int:
        raise self.error()

    def __contains__(self, key: Any) -> bool:
        raise self.error()

    def __bool__(self) -> bool:
        raise self.error()

    def __repr__(self) -> str:
        return f"<TrainState.{self.field} donated to the train step>"


def _refuse_flatten(donated: Any) -> Any:  # Any, as the node below: optree's stubs type a node as a Collection
    raise donated.error()


# A donated state flattens to the same error, in d9dfn's trees and in torch's (a live state never meets this).
_node: Any = Donated
_never_built: Any = lambda aux, children: None  # noqa: E731  (flatten raises first)
optree.register_pytree_node(_node, _refuse_flatten, _never_built, namespace=NAMESPACE)
torch_pytree.register_pytree_node(
    Donated, _refuse_flatten, lambda children, aux: None, serialized_type_name=f"{__name__}.Donated"
)


def consume(train_state: TrainState) -> TrainState:
    """Hand ``train_state`` over to a donating step: a new ``TrainState`` object with the same fields, for the step
    to run on, while ``train_state`` itself has its ``params`` and ``opt_state`` replaced by :class:`Donated` (the
    caller's reference now raises on any read of them). The rest of it (buffers, step, key, task and metric state)
    stays readable: the step does not write into those."""
    check_live(train_state)
    live = train_state.replace()
    donated_at = train_state.step
    object.__setattr__(train_state, "params", Donated("params", donated_at))  # the dataclass is frozen: on purpose
    object.__setattr__(train_state, "opt_state", Donated("opt_state", donated_at))
    return live


def check_live(train_state: TrainState) -> None:
    """Raise :meth:`Donated.error` when ``train_state`` was given to a donating step already."""
    for value in (train_state.params, train_state.opt_state):
        if isinstance(value, Donated):
            raise value.error()


@pytree_dataclass
class InferenceState:
    """The state an inference run carries: weights, the task's accumulating state, metrics, step, key."""

    params: Params
    buffers: Buffers
    step: torch.Tensor
    rng: torch.Tensor
    task_state: PyTree = None
    metric_state: PyTree = None

    if TYPE_CHECKING:  # added by ``pytree_dataclass``; declared here so that type checkers know it

        def replace(self, **changes: Any) -> Self:
            """Return a copy with ``changes`` applied; the original is unchanged."""
            ...


@pytree_dataclass
class StepOutput:
    """What one training step reports. Every field is a tensor: reading one is a host sync.

    Attributes:
        loss: ``Σwℓ / Σw`` over the step's microbatches (0-d float32).
        loss_weight: ``Σw`` (0-d).
        grad_norm: global L2 norm of the scaled gradient, before clipping (0-d).
        lr: the learning rate the optimizer update used, as its new state records it (``optim.learning_rate``;
            0-d float32, NaN when no transform in the optimizer records a rate).
        nonfinite: ``True`` when the loss or the gradient norm is NaN or infinite (0-d bool).
        skipped: ``True`` when the update was skipped for that reason (``skip_nonfinite=True``).
        logs: the tasks' extra values, averaged over microbatches with the loss weights.
    """

    loss: torch.Tensor
    loss_weight: torch.Tensor
    grad_norm: torch.Tensor
    lr: torch.Tensor
    nonfinite: torch.Tensor
    skipped: torch.Tensor
    logs: dict[str, torch.Tensor]


@pytree_dataclass
class EvalOutput:
    """What one evaluation step reports: the weighted loss, its weight, and the tasks' extra values."""

    loss: torch.Tensor
    loss_weight: torch.Tensor
    logs: dict[str, torch.Tensor]


def split_module_state(module: nn.Module) -> tuple[Params, Buffers]:
    """Split a module's tensors into its parameters (``params``, trainable or frozen) and its buffers.

    Tied parameters appear once, under their first name. Which params train is :func:`frozen_names`'s answer.

    Args:
        module: a materialized module (not on the meta device).

    Returns:
        ``(params, buffers)``, flat dicts of detached tensors sharing storage with the module.

    >>> params, buffers = split_module_state(nn.BatchNorm1d(3))
    >>> sorted(params), sorted(buffers)
    (['bias', 'weight'], ['num_batches_tracked', 'running_mean', 'running_var'])
    """
    params: Params = {}
    buffers: Buffers = {}
    for name, param in module.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"split_module_state: parameter {name!r} is on the meta device; materialize the module first "
                "(module.to_empty(device=...) then reset_parameters())"
            )
        params[name] = param.detach()
    for name, buffer in module.named_buffers():
        buffers[name] = buffer.detach()
    return params, buffers


def frozen_names(module: nn.Module, trainable: PathPredicate | None = None) -> tuple[str, ...]:
    """The names of ``module``'s frozen parameters, in its order: those without ``requires_grad``, and those that
    ``trainable(name, tensor)`` (if given) rejects (d9d's ``inject_peft_and_freeze`` freezes by ``requires_grad``).

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> frozen_names(net, lambda name, tensor: name.startswith("1."))
    ('0.weight', '0.bias')
    """
    return tuple(
        name
        for name, param in module.named_parameters()
        if not (param.requires_grad and (trainable is None or trainable(name, param)))
    )


def trainable_params(train_state: TrainState) -> Params:
    """``train_state``'s trainable params (its ``params`` without the :attr:`~TrainState.frozen` ones), in order:
    what the optimizer state mirrors and the step differentiates."""
    params = train_state.params
    if not train_state.frozen:
        return params
    frozen = frozenset(train_state.frozen)
    return {name: p for name, p in params.items() if name not in frozen}


def with_trainable(train_state: TrainState, trainable: Params) -> Params:
    """``train_state``'s params with the trainable ones replaced by ``trainable`` (the frozen ones kept), in
    ``train_state.params``' order."""
    if not train_state.frozen:
        return trainable
    frozen = frozenset(train_state.frozen)
    return {name: p if name in frozen else trainable[name] for name, p in train_state.params.items()}


def init_train_state(
    module: nn.Module,
    optimizer: Transform,
    *,
    task: Any = None,
    seed: int = 0,
    trainable: PathPredicate | None = None,
    task_state: PyTree = None,
    metric_state: PyTree = None,
    mesh: Any = None,
    placements: Any = None,
) -> TrainState:
    """The state of a run before its first step.

    Args:
        module: the materialized model whose tensors become ``params`` and ``buffers`` (copied, so later
            steps never touch the module).
        optimizer: the transform whose ``init`` builds ``opt_state`` over the trainable params only.
        task: the ``TrainTask``; its ``init_state()`` and ``create_metrics().init()`` fill ``task_state``
            and ``metric_state`` unless those are given.
        seed: the run's seed; becomes the ``rng`` key.
        trainable: optional predicate on (name, tensor); parameters it rejects, and those without
            ``requires_grad``, are frozen: they stay in ``params`` (placed like the others, sharded on a
            ``data_shard`` axis) and are named in ``frozen``; the step neither differentiates nor updates them and
            the optimizer state does not cover them.
        task_state: the task's initial state (overrides ``task.init_state()``).
        metric_state: the initial metric state (overrides the task's metrics).
        mesh: a data-parallel ``DeviceMesh`` (``d9dfn.loop.init_data_parallel_mesh``): the params
            (frozen ones too) become ``DTensor``s on it, replicated from its first rank or sharded along dim 0, and the
            optimizer state follows its params. A collective: every rank calls it. Buffers, the step and the
            key stay plain tensors, equal on every rank.
        placements: ``(name, tensor, mesh) -> placements`` per param (``ModelProvider.parallelize_model_stage``
            may supply one); default ``d9dfn.parallel.data_parallel_placements``. Needs ``mesh``.

    >>> import d9dfn.optim as optim
    >>> state = init_train_state(nn.Linear(2, 1), optim.sgd(0.1))
    >>> sorted(state.params), int(state.step)
    (['bias', 'weight'], 0)
    """
    params, buffers = split_module_state(module)
    frozen = frozen_names(module, trainable)
    params = {name: tensor.clone() for name, tensor in params.items()}
    buffers = {name: tensor.clone() for name, tensor in buffers.items()}
    device = _device_of(params, buffers)
    if mesh is not None:
        from d9dfn.parallel import distribute_params

        params = distribute_params(params, mesh, placements)
    elif placements is not None:
        raise ValueError("init_train_state: placements were given without a mesh; pass mesh=... as well")
    if task is not None:
        metric = task.create_metrics()
        task_state = task.init_state() if task_state is None else task_state
        metric_state = metric.init(device) if metric is not None and metric_state is None else metric_state
    opt_state = optimizer.init({name: p for name, p in params.items() if name not in frozen})
    return TrainState(
        params=params,
        buffers=buffers,
        opt_state=opt_state,
        step=torch.zeros((), dtype=torch.int64, device=device),
        rng=prng.key(seed).to(device),
        task_state=task_state if task_state is not None else {},
        metric_state=metric_state,
        frozen=frozen,
    )


def _device_of(*trees: dict[str, torch.Tensor]) -> torch.device:
    for tree in trees:
        for tensor in tree.values():
            return tensor.device
    return torch.device("cpu")
