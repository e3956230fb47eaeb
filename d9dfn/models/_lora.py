"""Parameter-efficient fine-tuning as a transform of a model: LoRA adapters on chosen linear maps, and full tuning of
chosen modules (d9d's ``d9d.peft``: ``LoRA``, ``FullTune``, stacked; names kept where they fit).

:func:`apply_peft` returns a copy of a model whose targeted :class:`~d9dfn.models._layers.Linear` maps are
:class:`LoRALinear` (the base ``weight`` and ``bias`` under their own names, plus ``lora_A.weight`` (rank, in) and
``lora_B.weight`` (out, rank), PEFT's names); :func:`peft_trainable` is the predicate on (name, tensor) that says which
params train (the adapters and the params of the ``FullTune`` targets): the loop passes it to
``init_train_state(trainable=...)``, so every other param is frozen (no gradient, no optimizer state;
``docs/design/layout.md``). :func:`merge_lora` folds trained adapters into their base weights
(``W + alpha/rank · B @ A``), the model a plain export holds.

``lora_B`` starts at zero, so the adapted model computes exactly what its base does until the first step; ``lora_A``
is drawn as PEFT draws it (Kaiming-uniform with ``a=sqrt(5)``: ``U(±1/sqrt(in))``) from a generator of its own, seeded
by torch's seed and the module's name, so the base's init draws the same numbers with or without adapters. Dropout on
the adapter's input is pure (:func:`~d9dfn.models._layers.dropout`): its mask comes from a key the decoder folds in per
projection, so a resumed run draws the same masks.

Targets are regular expressions matched (``fullmatch``) against a module's full name (``layers.0.self_attn.q_proj``)
or its last part (``q_proj``): ``"q_proj|v_proj"`` adapts every layer's query and value maps, and
``r"layers\\.0\\..*_proj"`` the projections of layer 0 only.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import zlib
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from d9dfn._types import Params, PathPredicate
from d9dfn.models._layers import Linear, dropout

__all__ = [
    "FullTune",
    "LoRA",
    "LoRALinear",
    "PeftMethod",
    "adapter_plan",
    "apply_peft",
    "check_targets",
    "lora_modules",
    "merge_lora",
    "peft_trainable",
    "target_names",
]


def adapter_plan(plan: Mapping[str, tuple[str, ...]]) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The adapters' rows of a family's plan, and what their gradients sum over: ``(dims, sums_over)``, to add to the
    family's ``plan`` and ``sums_over`` for a model :func:`apply_peft` gave adapters.

    Each Linear weight of ``plan`` (two dims, ``(out, in)``) gives its adapter's factors its dims: ``lora_A`` is
    ``("lora_rank", in)`` and ``lora_B`` is ``(out, "lora_rank")``, so an adapter splits with its base. Over a tensor
    axis a column-parallel base (``out`` split: q/k/v, gate/up, the vocabulary-parallel head) keeps ``lora_A`` whole
    and splits ``lora_B``'s rows, and a row-parallel one (``in`` split: o, down) splits ``lora_A``'s columns and keeps
    ``lora_B`` whole. The whole factor's gradient is then a partial sum on each rank (the column-parallel ``lora_A``
    sees this rank's output rows only; the row-parallel ``lora_B`` this rank's part of ``A x``), so each sums over the
    other factor's split dim (``sums_over``: ``lora_A`` over ``out``, ``lora_B`` over ``in``). ``lora_rank`` is a
    name no rules table splits; an expert axis splits none of these dims, so beside experts the adapters are
    replicated and stored as the data-parallel axes store any param.

    >>> dims, sums = adapter_plan({"layers.*.o_proj.weight": ("embed", "heads"), "norm.weight": ("embed",)})
    >>> dims
    {'layers.*.o_proj.lora_A.weight': ('lora_rank', 'heads'), 'layers.*.o_proj.lora_B.weight': ('embed', 'lora_rank')}
    >>> sums
    {'layers.*.o_proj.lora_A.weight': ('embed',), 'layers.*.o_proj.lora_B.weight': ('heads',)}
    """
    dims: dict[str, tuple[str, ...]] = {}
    sums: dict[str, tuple[str, ...]] = {}
    for pattern, named in plan.items():
        if not pattern.endswith(".weight") or len(named) != 2:
            continue
        base = pattern.removesuffix(".weight")
        out, in_ = named
        dims[f"{base}.lora_A.weight"], sums[f"{base}.lora_A.weight"] = ("lora_rank", in_), (out,)
        dims[f"{base}.lora_B.weight"], sums[f"{base}.lora_B.weight"] = (out, "lora_rank"), (in_,)
    return dims, sums


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on the linear maps ``targets`` matches: ``y = W x + b + alpha/rank · B A drop(x)``.

    Attributes:
        targets: a regular expression over module names (full name or last part, ``fullmatch``).
        rank: the adapters' inner dimension, >= 1.
        alpha: the scale's numerator (``scaling = alpha / rank``, PEFT's ``lora_alpha``), > 0.
        dropout: the probability of dropping an input element of the adapter, in [0, 1).

    >>> LoRA("q_proj", rank=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LoRA(targets='q_proj'): rank=0; give a rank of at least 1 (e.g. 8 or 16)
    """

    targets: str
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _compile(self)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(
                f"LoRA(targets={self.targets!r}): rank={self.rank!r}; give a rank of at least 1 (e.g. 8 or 16)"
            )
        if not self.alpha > 0:
            raise ValueError(f"LoRA(targets={self.targets!r}): alpha={self.alpha!r}; give alpha > 0 (e.g. 2 * rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA(targets={self.targets!r}): dropout={self.dropout!r}; give a probability in [0, 1)")

    @property
    def scaling(self) -> float:
        """``alpha / rank``: what the adapters' product is multiplied by."""
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class FullTune:
    """Every param of the modules ``targets`` matches trains as it is (d9d's ``FullTune``).

    Attributes:
        targets: a regular expression over module names (full name or last part, ``fullmatch``).
    """

    targets: str

    def __post_init__(self) -> None:
        _compile(self)


PeftMethod = LoRA | FullTune
"""One method of a stack (``trainer.peft`` is a list of them, applied in order)."""


def _compile(method: PeftMethod) -> re.Pattern[str]:
    try:
        return re.compile(method.targets)
    except re.error as error:
        raise ValueError(
            f"{type(method).__name__}(targets={method.targets!r}): not a regular expression ({error}); give one "
            "such as 'q_proj|v_proj'"
        ) from None


def _matches(pattern: re.Pattern[str], name: str) -> bool:
    return bool(name) and bool(pattern.fullmatch(name) or pattern.fullmatch(name.rsplit(".", 1)[-1]))


class LoRALinear(nn.Module):
    """A :class:`~d9dfn.models._layers.Linear` with a low-rank adapter: ``W x + b + scaling · B A drop(x)``.

    The base's ``weight`` and ``bias`` keep their names (so the base's checkpoints and Hugging Face mapping still
    fit); the adapter's factors are ``lora_A.weight`` (rank, in) and ``lora_B.weight`` (out, rank).

    Args:
        base: the linear map to adapt (its parameters are shared, not copied).
        rank, alpha, dropout: as :class:`LoRA`'s.
        name: the module's full name; it seeds the draw of ``lora_A`` (with torch's seed).

    >>> torch.manual_seed(0) and None
    >>> base = Linear(4, 3, init_std=0.02)
    >>> base.reset_parameters()
    >>> lora = LoRALinear(base, rank=2, alpha=4.0, name="proj")
    >>> lora.reset_parameters()
    >>> x = torch.randn(5, 4)
    >>> torch.equal(lora(x), base(x))  # B starts at zero
    True
    """

    def __init__(self, base: Linear, *, rank: int, alpha: float, dropout: float = 0.0, name: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features, self.init_std = base.in_features, base.out_features, base.init_std
        self.rank, self.alpha, self.dropout, self.name = rank, alpha, dropout, name
        self.scaling = alpha / rank
        self.weight = base.weight
        self.bias = base.bias
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = _Factor(rank, base.in_features, device=device, dtype=dtype)
        self.lora_B = _Factor(base.out_features, rank, device=device, dtype=dtype)

    @property
    def keyed(self) -> bool:
        """Whether ``forward`` wants a key (its dropout is on): the decoder folds one in per projection."""
        return self.dropout > 0

    def reset_parameters(self) -> None:
        """Draw the base as :class:`Linear` does (the same draws from torch's generator), ``lora_A`` from a generator
        of its own (Kaiming-uniform, ``a=sqrt(5)``, as PEFT), and zero ``lora_B``."""
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self.reset_adapter()

    def reset_adapter(self) -> None:
        """Draw ``lora_A`` and zero ``lora_B`` (the base is left as it is); torch's generator is not advanced."""
        generator = torch.Generator().manual_seed((torch.initial_seed() + zlib.crc32(self.name.encode())) % 2**63)
        a = torch.empty(self.lora_A.weight.shape)  # drawn on the CPU, in float32: the same numbers on any device
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """(..., in) -> (..., out); the adapter's input is dropped with a mask from ``key`` when given and
        ``dropout > 0``."""
        return F.linear(x, self.weight, self.bias) + self.delta(x, key)

    def delta(self, x: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """The adapter's term alone, ``scaling · B A drop(x)``: (..., in) -> (..., out). A row-parallel base under
        tensor parallelism adds it to its partial output before the sum over the group (``models/_decoder.py``)."""
        h = dropout(x, self.dropout, key) if key is not None and self.dropout > 0 else x
        # (..., in) -> (..., rank) -> (..., out), scaled after the product (PEFT's order).
        return F.linear(F.linear(h, self.lora_A.weight), self.lora_B.weight) * self.scaling

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha:g}, dropout={self.dropout:g}"
        )


class _Factor(nn.Module):
    """One factor of an adapter, a ``weight`` (rows, cols) that its :class:`LoRALinear` initializes."""

    def __init__(self, rows: int, cols: int, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """Nothing: the :class:`LoRALinear` above draws this factor (``reset_adapter``), before it in module order.
        Defined so that a per-module init that requires one from every module owning tensors (a pipeline stage's
        ``seeded_reset``) accepts the adapter; a factor no parent drew still fails the loop's poison check."""


def target_names(model: nn.Module, method: PeftMethod) -> list[str]:
    """The names of the modules of ``model`` that ``method`` targets: ``Linear`` maps (a :class:`LoRA`, not yet
    adapted), or modules holding params (a :class:`FullTune`), in the model's order."""
    pattern = _compile(method)
    if isinstance(method, LoRA):
        return [name for name, m in model.named_modules() if type(m) is Linear and _matches(pattern, name)]
    return [name for name, m in model.named_modules() if _matches(pattern, name) and any(True for _ in m.parameters())]


def check_targets(model: nn.Module, methods: Sequence[PeftMethod]) -> None:
    """Raise unless every method targets at least one module of ``model`` and no two LoRA methods adapt the same one.

    Raises:
        ValueError: ``methods[i]: ...``, naming the regex and a few names of the modules it could match.
    """
    adapted: dict[str, int] = {}
    for index, method in enumerate(methods):
        names = target_names(model, method)
        if not names:
            kind = "Linear module" if isinstance(method, LoRA) else "module holding parameters"
            candidates = [
                name
                for name, m in model.named_modules()
                if name and (type(m) is Linear if isinstance(method, LoRA) else any(True for _ in m.parameters()))
            ]
            raise ValueError(
                f"methods[{index}]: targets={method.targets!r} matches no {kind} of {type(model).__name__} (matched "
                f"against the full name and its last part); names there: {', '.join(_few(candidates))}"
            )
        if isinstance(method, LoRA):
            for name in names:
                if name in adapted:
                    raise ValueError(
                        f"methods[{index}]: targets={method.targets!r} matches {name}, which methods[{adapted[name]}] "
                        "already adapts; narrow one of the two regexes so that each map gets one adapter"
                    )
                adapted[name] = index


def _few(names: list[str], limit: int = 8) -> list[str]:
    """Up to ``limit`` names, one of each last part first (``layers.0.self_attn.q_proj``, ``...k_proj``, ...)."""
    seen: dict[str, str] = {}
    for name in names:
        seen.setdefault(name.rsplit(".", 1)[-1], name)
    few = list(seen.values())[:limit]
    return few + ([f"... ({len(names)} in all)"] if len(names) > len(few) else [])


def apply_peft(model: nn.Module, methods: Sequence[PeftMethod], *, check: bool = True) -> nn.Module:
    """A copy of ``model`` with the :class:`LoRA` methods' adapters in place (``model`` is not changed); the
    :class:`FullTune` methods change no module (:func:`peft_trainable` says what trains).

    Build the model on the meta device to adapt it before any memory is allocated; a materialized copy keeps the base
    weights and gets freshly initialized adapters. Targets are checked (:func:`check_targets`) unless ``check`` is
    false (a pipeline stage holds a part of the model: check the whole model once instead).

    >>> from d9dfn.models import Qwen3Config, Qwen3LM
    >>> adapted = apply_peft(Qwen3LM(Qwen3Config.tiny()), [LoRA("q_proj|v_proj", rank=4)])
    >>> sorted(name for name, _ in adapted.named_parameters() if "lora" in name)[:2]
    ['layers.0.self_attn.q_proj.lora_A.weight', 'layers.0.self_attn.q_proj.lora_B.weight']
    """
    if check:
        check_targets(model, methods)
    if not any(isinstance(method, LoRA) for method in methods):
        return model
    adapted = copy.deepcopy(model)
    for method in methods:
        if not isinstance(method, LoRA):
            continue
        for name in target_names(adapted, method):
            base = adapted.get_submodule(name)
            assert isinstance(base, Linear)
            lora = LoRALinear(base, rank=method.rank, alpha=method.alpha, dropout=method.dropout, name=name)
            if not base.weight.is_meta:  # a materialized base keeps its weights: only the adapter is drawn
                with torch.no_grad():
                    lora.reset_adapter()
            adapted.set_submodule(name, lora)
    return adapted


def peft_trainable(methods: Sequence[PeftMethod]) -> PathPredicate:
    """Which params train under ``methods``: the adapters (``...lora_A.weight``, ``...lora_B.weight``) and every param
    under a module a :class:`FullTune` targets; the rest of the model is frozen.

    >>> trains = peft_trainable([LoRA("q_proj"), FullTune("norm")])
    >>> names = ("layers.0.self_attn.q_proj.lora_A.weight", "norm.weight", "layers.0.mlp.up_proj.weight")
    >>> [trains(name, None) for name in names]
    [True, True, False]
    """
    full = [_compile(method) for method in methods if isinstance(method, FullTune)]

    def trains(name: str, tensor: object) -> bool:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in ("lora_A", "lora_B"):
            return True
        modules = [".".join(parts[:i]) for i in range(1, len(parts))]  # every module above the param
        return any(_matches(pattern, module) for pattern in full for module in modules)

    return trains


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """``model``'s adapted maps by name, in its order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(params: Mapping[str, torch.Tensor], scalings: Mapping[str, float]) -> Params:
    """``params`` with each adapter folded into its base weight, ``W + scaling · B @ A`` (in ``W``'s dtype), and the
    adapters dropped: the params of the base model that computes what the adapted one does (without dropout).

    Args:
        params: an adapted model's params, flat by name (a train state's, a checkpoint's).
        scalings: ``alpha / rank`` by adapted module name (``{name: m.scaling for name, m in
            lora_modules(model).items()}``).

    Raises:
        ValueError: a module of ``scalings`` whose base weight or factors are not in ``params``.

    >>> w, a, b = torch.zeros(2, 3), torch.ones(1, 3), torch.ones(2, 1)
    >>> merged = merge_lora({"p.weight": w, "p.lora_A.weight": a, "p.lora_B.weight": b}, {"p": 2.0})
    >>> sorted(merged), merged["p.weight"][0].tolist()
    (['p.weight'], [2.0, 2.0, 2.0])
    """
    merged = dict(params)
    for name, scaling in scalings.items():
        keys = (f"{name}.weight", f"{name}.lora_A.weight", f"{name}.lora_B.weight")
        missing = [key for key in keys if key not in params]
        if missing:
            raise ValueError(f"merge_lora: params have no {missing} for adapted module {name}; pass an adapted model's")
        weight, a, b = (params[key] for key in keys)
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * scaling  # (out, rank) @ (rank, in) -> (out, in)
        merged[keys[0]] = (weight.to(torch.float32) + delta).to(weight.dtype)
        del merged[keys[1]], merged[keys[2]]
    return merged
