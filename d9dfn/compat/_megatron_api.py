"""Megatron Bridge's call conventions: ``GlobalState``, forward-step signatures, loss-function returns.

The pieces of :mod:`d9dfn.compat.megatron` that describe Megatron's side of the contract; the task,
model wrapper and ``pretrain`` that use them live in ``megatron.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from d9dfn._task import ComputeLossResult
from d9dfn._types import Batch

if TYPE_CHECKING:
    pass

__all__ = [
    "ForwardStepSignature",
    "GlobalState",
    "Timer",
    "Timers",
    "TrainStateView",
    "call_forward_step",
    "inspect_forward_step",
    "loss_func_result",
]

_STATE_NAMES = ("state", "global_state")
_PLAN = "return_schedule_plan"


# --- GlobalState -----------------------------------------------------------------------------------------


class Timer:
    """One named timer: Megatron's ``start`` / ``stop`` / ``elapsed``, all no-ops inside the traced step."""

    def __init__(self, name: str) -> None:
        self.name = name

    def start(self, barrier: bool = False) -> None:
        """Does nothing (trace-safe)."""

    def stop(self, barrier: bool = False) -> None:
        """Does nothing (trace-safe)."""

    def reset(self) -> None:
        """Does nothing (trace-safe)."""

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Always ``0.0``: wall-clock time is measured by the loop and the profiler, not in the graph."""
        return 0.0


class Timers:
    """``timers(name, log_level=None) -> Timer``, as Megatron's; remembers the names asked for in eager runs.

    Under ``torch.compile`` nothing is recorded (recording would be a guard on Python state, and a
    recompile); run one step with ``compile=False`` to list the timers a forward step uses.

    >>> timers = Timers()
    >>> timers("forward-step", log_level=2).start()
    >>> timers.names
    ('forward-step',)
    """

    def __init__(self) -> None:
        self._names: dict[str, None] = {}

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        # Recorded in eager runs only: under torch.compile any read or write of this dict becomes a guard on
        # its contents, and the first recorded name would recompile the step.
        if not torch.compiler.is_compiling():
            self._names[name] = None
        return Timer(name)

    @property
    def names(self) -> tuple[str, ...]:
        """The timer names the forward step used in eager calls, in first-use order."""
        return tuple(self._names)


@dataclasses.dataclass(frozen=True)
class TrainStateView:
    """Megatron's ``state.train_state``, reduced to what the pure step knows: ``step`` (0-d int64 tensor)."""

    step: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class GlobalState:
    """The ``state`` a Megatron forward step receives: a read-only view built per call.

    Attributes:
        cfg: the job's config (``MegatronTask(config=...)``; ``pretrain`` passes its ``TrainerConfig``).
        timers: :class:`Timers` whose timers are no-ops inside the step.
        train_state: ``.step`` as in Megatron Bridge.
        step: the 0-d optimizer-step tensor (``None`` in forward-only use).
    """

    cfg: Any
    timers: Timers
    train_state: TrainStateView
    step: torch.Tensor | None


# --- the forward step's signature ------------------------------------------------------------------------


class ForwardStepSignature(NamedTuple):
    """How to call a forward step: with a leading ``state``, and with ``return_schedule_plan``."""

    takes_state: bool
    takes_schedule_plan: bool


def _names_global_state(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        return annotation.rsplit(".", 1)[-1].strip("'\" ") == "GlobalState"
    return annotation is GlobalState or getattr(annotation, "__name__", None) == "GlobalState"


def inspect_forward_step(forward_step: Callable[..., Any]) -> ForwardStepSignature:
    """Which of Megatron Bridge's forward-step signatures ``forward_step`` has; checked once, at the edge.

    Accepted (functions, ``functools.partial`` objects, bound methods and functor instances alike):
    ``(data_iterator, model)``, ``(state, data_iterator, model)``, ``(data_iterator, model,
    return_schedule_plan=False)`` and ``(state, data_iterator, model, return_schedule_plan=False)``. The
    first parameter is the state when it is annotated ``GlobalState`` or named ``state`` /
    ``global_state``, as in Megatron Bridge.

    Raises:
        TypeError: anything else; the message shows the signature found and the accepted ones.

    >>> def forward_step(state: GlobalState, data_iterator, model, return_schedule_plan=False): ...
    >>> inspect_forward_step(forward_step)
    ForwardStepSignature(takes_state=True, takes_schedule_plan=True)
    """
    fn = "inspect_forward_step"
    accepted = (
        "(data_iterator, model), (state: GlobalState, data_iterator, model), (data_iterator, model, "
        "return_schedule_plan=False) or (state: GlobalState, data_iterator, model, return_schedule_plan=False)"
    )
    if isinstance(forward_step, type):
        raise TypeError(
            f"{fn}: got the class {forward_step.__name__}; pass an instance of the functor, "
            f"e.g. {forward_step.__name__}(...)"
        )
    if not callable(forward_step):
        raise TypeError(f"{fn}: expected a callable forward step, got {type(forward_step).__name__}")
    try:
        signature = inspect.signature(forward_step)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{fn}: cannot read the signature of {forward_step!r} ({error}); pass a Python function"
        ) from error
    params = list(signature.parameters.values())
    name = getattr(forward_step, "__qualname__", type(forward_step).__qualname__)

    def reject(why: str) -> TypeError:
        return TypeError(f"{fn}: {name}{signature} {why}; a forward step has one of the signatures {accepted}")

    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise reject("takes *args or **kwargs, so its arguments cannot be told apart")
    takes_plan = bool(params) and params[-1].name == _PLAN
    core = params[:-1] if takes_plan else params
    if any(p.name == _PLAN for p in core):
        raise reject(f"has {_PLAN} before its last parameter")
    if any(p.kind == p.KEYWORD_ONLY for p in core):
        raise reject("has keyword-only parameters")
    looks_like_state = bool(core) and (_names_global_state(core[0].annotation) or core[0].name in _STATE_NAMES)
    if len(core) == 2 and not looks_like_state:
        return ForwardStepSignature(takes_state=False, takes_schedule_plan=takes_plan)
    if len(core) == 3 and looks_like_state:
        return ForwardStepSignature(takes_state=True, takes_schedule_plan=takes_plan)
    if len(core) == 3:
        raise reject(
            f"has 3 parameters but the first, {core[0].name!r}, is neither annotated GlobalState nor named "
            "'state' or 'global_state'"
        )
    raise reject(f"has {len(core)} parameter(s) besides {_PLAN}")


def call_forward_step(
    fn: str,
    forward_step: Callable[..., Any],
    signature: ForwardStepSignature,
    state: GlobalState,
    batch: Batch,
    model: Callable[..., Any],
) -> tuple[Any, Callable[[Any], Any]]:
    args = ((state,) if signature.takes_state else ()) + (iter((batch,)), model)
    kwargs = {_PLAN: False} if signature.takes_schedule_plan else {}
    result = forward_step(*args, **kwargs)
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and callable(result[1])):
        raise TypeError(
            f"{fn}: the forward step returned {type(result).__name__}"
            f"{f' of length {len(result)}' if isinstance(result, (tuple, list)) else ''}; a Megatron forward step "
            "returns (output_tensor, loss_func) with loss_func callable, e.g. (output, partial(loss_func, mask))"
        )
    return result[0], result[1]


# --- the loss function's return --------------------------------------------------------------------------


def _scalar(fn: str, what: str, value: Any, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(value, device=device) if not isinstance(value, torch.Tensor) else value
    if tensor.numel() != 1:
        raise ValueError(
            f"{fn}: {what} has shape {tuple(tensor.shape)}; it must hold one value (a 0-d tensor): reduce it with "
            ".sum() or .mean()"
        )
    return tensor.reshape(())


def _log_value(fn: str, key: str, value: Any, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(value, device=device) if not isinstance(value, torch.Tensor) else value
    tensor = tensor.detach().float()
    if tensor.numel() == 1:
        return tensor.reshape(())
    if tensor.numel() == 2:  # Megatron's reporting pair [sum, count]
        total, count = tensor.reshape(2).unbind()
        return torch.where(count != 0, total / torch.where(count != 0, count, torch.ones_like(count)), 0.0)
    raise ValueError(
        f"{fn}: reduced[{key!r}] has shape {tuple(tensor.shape)}; a reduced value is a 0-d tensor or a "
        "[sum, count] pair: reduce it before returning it"
    )


def _is_loss_return(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) in (2, 3)
        and isinstance(value[0], torch.Tensor)
        and isinstance(value[-1], Mapping)
    )


def loss_func_result(value: Any, *, fn: str = "loss_func_result") -> ComputeLossResult:
    """Translate what a Megatron ``loss_func`` returned into d9dfn's ``ComputeLossResult``.

    Args:
        value: ``(loss, reduced)`` or ``(loss_sum, num_tokens, reduced)``.
        fn: the caller's name, for error messages.

    Returns:
        ``ComputeLossResult(loss, None, logs=reduced)`` for the two-tuple; for the three-tuple
        ``loss = loss_sum / num_tokens`` (0 when ``num_tokens`` is 0) with ``loss_weight = num_tokens``.

    Raises:
        TypeError: ``value`` is neither (inference data: use :class:`MegatronInferenceTask`).
        ValueError: a loss, count or reduced value holds more than one number (a pair for reduced values).

    >>> result = loss_func_result((torch.tensor(6.0), torch.tensor(3), {"lm loss": torch.tensor([6.0, 3.0])}))
    >>> result.loss, result.loss_weight, result.logs
    (tensor(2.), tensor(3.), {'lm loss': tensor(2.)})
    """
    if not _is_loss_return(value):
        raise TypeError(
            f"{fn}: loss_func returned {type(value).__name__}, not (loss, reduced_dict) or (loss_sum, num_tokens, "
            "reduced_dict); to train, return one of those; to collect inference data, use MegatronInferenceTask"
        )
    loss = _scalar(fn, "the loss", value[0], value[0].device)
    logs = {str(key): _log_value(fn, str(key), item, loss.device) for key, item in value[-1].items()}
    if len(value) == 2:
        return ComputeLossResult(loss=loss, logs=logs)
    num_tokens = _scalar(fn, "num_tokens", value[1], loss.device).detach().to(torch.float32)
    # n · (s / n) = s: the step's Σ wℓ / Σ w is Σ loss_sum / Σ num_tokens; an empty microbatch adds 0 to both.
    return ComputeLossResult(loss=loss.float() / num_tokens.clamp(min=1.0), loss_weight=num_tokens, logs=logs)
