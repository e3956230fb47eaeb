"""A model's repeated blocks, and the per-block runner: each block class compiled once for all its instances.

A model of ``L`` identical blocks compiled whole costs a compile per block: inductor sees ``L`` copies. torch's
``nested_compile_region`` traces the first call of a function and reuses that subgraph for every later call with
matching inputs, so the blocks stop adding to cold compile time. On torch 2.13 it works only in one form
(``docs/design/step.md``, "Compiling a repeated block once"), which this module owns:

- the region is the block class's ``forward``, set on a *copy* of the module (a subclass assigned to the copied
  instances; the caller's classes and modules are untouched);
- the params are swapped into that copy *outside* the compiled call (:func:`swapped_in`), so every reused block
  reads its own tensors, and the gradient comes from autograd (AOTAutograd's compiled backward), not from
  ``torch.func`` (which does not trace through a region);
- inductor's buffer reuse is off for the compiled call (:func:`region_compile`): with it on, inductor reuses the
  storage of tensors a region saved for backward, and the gradients are wrong.

:class:`RegionalStages` is that form as a pipeline :class:`~d9dfn.pipeline.StageRunner`: a whole model is its one
stage (the sequential executor), a pipeline stage is a run of blocks, so per-block compilation works inside
pipeline stages as it does in one process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.nn.utils import stateless

from d9dfn._torch import REGION_INDUCTOR_OPTIONS, compile_piece, region_tracing
from d9dfn._types import Buffers, Params
from d9dfn.parallel._gather import BlockLayout
from d9dfn.parallel._plan import ParallelPlan
from d9dfn.parallel._prefetch import prefetching_backend
from d9dfn.pipeline import Program, Stage, StageConsts, stage_args
from d9dfn.pipeline._executor import Post
from d9dfn.step._call import checked_outputs, for_compute, stage_call
from d9dfn.step._checkpointing import ActivationCheckpointing, checkpointed_forward
from d9dfn.step._gathered import Gathering, gathered_class, plan_gathering
from d9dfn.step._microbatches import structural_copy
from d9dfn.step._precision import Precision

__all__ = [
    "RegionalStages",
    "find_repeated_blocks",
    "repeated_classes",
    "resolve_blocks",
    "with_block_regions",
    "written_buffer",
]

BlockChoice = Sequence[type[nn.Module]] | Literal["auto"]
"""Which classes are a model's repeated blocks: named, or ``"auto"`` (:func:`find_repeated_blocks`)."""


def written_buffer(module: nn.Module) -> str | None:
    """The name (under ``module``) of a buffer its forward may write, or ``None``: every buffer but those a submodule
    declares in its class attribute ``read_only_buffers`` (state the forward only reads, changed between steps by the
    train step's :class:`~d9dfn.StateUpdate`: an MoE layer's balancing bias). torch's nested compile regions cannot
    train through a written buffer (BatchNorm's statistics, written in place); a read one is an input like a param.

    >>> written_buffer(nn.BatchNorm1d(2)), written_buffer(nn.Linear(2, 2))
    ('running_mean', None)
    """
    for owner_name, owner in module.named_modules():
        read_only = frozenset(getattr(owner, "read_only_buffers", ()))
        for name, _ in owner.named_buffers(recurse=False):
            if name not in read_only:
                return f"{owner_name}.{name}" if owner_name else name
    return None


def find_repeated_blocks(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of ``model``'s repeated blocks: a class with at least two instances that are children of
    stacks of layers, none holding a buffer its forward may write (:func:`written_buffer`); or the classes a Hugging
    Face model declares in ``_no_split_modules`` that it holds twice or more.

    A stack of layers is an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` whose children are named by
    their index (``0``, ``1``, ...; the instances may be spread over several stacks: a pipeline's stage modules).
    A container keyed by anything else is a wrapper's table, not a stack: peft's LoRA layers keep their adapters
    in ``ModuleDict``s keyed by adapter name (``lora_A["default"]``, a ``Linear``), one per wrapped projection,
    and those ``Linear``s are not the model's blocks.

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    ...         self.head = nn.Linear(2, 1)
    >>> find_repeated_blocks(Net())
    (<class 'torch.nn.modules.linear.Linear'>,)
    """
    counts: Counter[type[nn.Module]] = Counter()
    found: list[type[nn.Module]] = []
    for container in model.modules():
        if _is_layer_stack(container):
            children = Counter(type(child) for child in container.children())
            for cls, count in children.items():
                counts[cls] += count
    declared = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    for module in model.modules():
        cls = type(module)
        if cls in found:
            continue
        repeated = counts[cls] >= 2
        if not repeated and cls.__name__ in declared:
            repeated = sum(type(m) is cls for m in model.modules()) >= 2
        if repeated and not any(written_buffer(m) is not None for m in model.modules() if type(m) is cls):
            found.append(cls)
    # Outermost classes only: a block's own sublayers repeat too (its projections), but the block holds them.
    return tuple(cls for cls in found if not any(_inside(model, cls, outer) for outer in found if outer is not cls))


def _is_layer_stack(module: nn.Module) -> bool:
    """Whether ``module`` is a container of layers named by their index (a ``ModuleList``, or a ``Sequential`` /
    ``ModuleDict`` whose keys are all integers: ``Qwen3LM.layers`` keys its blocks by their global index)."""
    if isinstance(module, nn.ModuleList):
        return True
    return isinstance(module, (nn.Sequential, nn.ModuleDict)) and all(name.isdigit() for name in module._modules)


def _inside(model: nn.Module, inner: type[nn.Module], outer: type[nn.Module]) -> bool:
    """Whether every instance of ``inner`` sits inside an instance of ``outer``."""
    outers = [m for m in model.modules() if type(m) is outer]
    inners = [m for m in model.modules() if type(m) is inner]
    return all(any(any(sub is m for sub in o.modules()) for o in outers) for m in inners)


def repeated_classes(model: nn.Module) -> list[str]:
    """The names of the module classes that occur more than once in ``model``, sorted: the candidates an error
    lists."""
    counts = Counter(type(module).__name__ for module in model.modules())
    return sorted(name for name, count in counts.items() if count > 1)


def resolve_blocks(
    owner: str, model: nn.Module | Sequence[nn.Module], blocks: BlockChoice
) -> tuple[type[nn.Module], ...]:
    """``blocks`` checked against ``model`` (or a pipeline's stage modules, together): ``"auto"`` finds them; named
    classes must occur and hold no buffer their forward may write (:func:`written_buffer`; read-only ones, such as an
    MoE layer's balancing bias, are inputs like params).

    Raises:
        ValueError: a named class that no submodule of ``model`` is an instance of, or an instance that holds a
            buffer it may write (torch 2.13 refuses to train a region that may write into them).
    """
    roots = [model] if isinstance(model, nn.Module) else list(model)
    together = roots[0] if len(roots) == 1 else nn.ModuleList(roots)
    if blocks == "auto":
        return find_repeated_blocks(together)
    wanted = tuple(dict.fromkeys(blocks))
    present = {type(module) for root in roots for module in root.modules()}
    for cls in wanted:
        if cls not in present:
            raise ValueError(
                f"{owner}: repeated_blocks names {cls.__module__}.{cls.__qualname__}, but no module of "
                f"{type(roots[0]).__name__} is one; pass the class of the model's repeated block (classes here that "
                f"occur more than once: {repeated_classes(together)})"
            )
    for name, module in (named for root in roots for named in root.named_modules()):
        buffer = written_buffer(module) if type(module) in wanted else None
        if buffer is not None:
            raise ValueError(
                f"{owner}: repeated_blocks includes {type(module).__name__}, but {name}.{buffer} is a buffer its "
                "forward may write; torch's nested compile regions cannot train through a written buffer (BatchNorm "
                "writes its statistics in place), so pass repeated_blocks without that class (a buffer the forward "
                "only reads: name it in its module's read_only_buffers)"
            )
    return wanted


RegionClasses = dict[tuple[type[nn.Module], ActivationCheckpointing | None, bool], type[nn.Module]]
"""One step's region classes, by (block class, checkpointing, gathered): made once per step, so every block of a class
shares one region, and no region is shared between steps (a region traced by another step, with other constants,
would turn them into inputs it cannot take)."""


def _region_class(
    cls: type[nn.Module], checkpointing: ActivationCheckpointing | None, classes: RegionClasses
) -> type[nn.Module]:
    """``cls`` with ``forward`` as one nested compile region (torch reuses a region per function), the forward run
    under ``checkpointing``'s checkpoint inside it when given: inside, so that a selective policy sees the block's ops
    (outside, it would see one op, the region)."""
    key = (cls, checkpointing, False)
    if key not in classes:
        forward = cls.forward if checkpointing is None else checkpointed_forward(cls.forward, checkpointing)
        names = {
            "forward": torch.compiler.nested_compile_region(forward),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        classes[key] = type(cls.__name__, (cls,), names)
    return classes[key]


def with_block_regions(
    module: nn.Module,
    blocks: Sequence[type[nn.Module]],
    checkpointed: frozenset[str] = frozenset(),
    checkpointing: ActivationCheckpointing | None = None,
    gathered: Mapping[str, BlockLayout] | None = None,
    classes: RegionClasses | None = None,
    inline_gathered: bool = False,
) -> nn.Module:
    """A structural copy of ``module`` (same tensors) whose instances of ``blocks`` each run as one shared region;
    those named in ``checkpointed`` under ``checkpointing``'s activation checkpoint; those in ``gathered`` wrapped in a
    :class:`~d9dfn.step._gathered.GatheredBlock` (a region too) that gathers their sharded params at each call.
    ``classes``: the step's region classes (:data:`RegionClasses`), filled as needed; default: new ones.
    ``inline_gathered``: the gathered blocks' forward inlined into the caller's graph instead (prefetch reorders
    their gathers there)."""
    wanted, gathered, classes = frozenset(blocks), gathered or {}, {} if classes is None else classes
    copied = structural_copy(module)
    for name, sub in list(copied.named_modules()):
        if type(sub) not in wanted:
            continue
        policy = checkpointing if name in checkpointed else None
        if name in gathered:
            parent_name, _, child = name.rpartition(".")
            parent = copied.get_submodule(parent_name) if parent_name else copied
            block = gathered_class(type(sub), policy, classes, region=not inline_gathered)
            parent._modules[child] = block(sub, gathered[name])
        else:
            sub.__class__ = _region_class(type(sub), policy, classes)
    return copied


@contextlib.contextmanager
def swapped_in(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``model``'s params and buffers replaced by ``tensors`` (every one of them, by name) for the ``with`` body.

    The names are checked against the module once per set of names (torch's strict check walks every submodule:
    0.2 ms, paid per microbatch otherwise); the copies this swaps into never change their structure. A tied weight
    (one ``Parameter`` under two names: a Hugging Face model's ``lm_head.weight`` and its embedding) comes once,
    under its first name (``split_module_state``'s), and fills every name it has, as ``functional_call`` does.
    """
    tensors = dict(tensors)
    tensors.update({alias: tensors[first] for alias, first in _tied_aliases(model).items() if first in tensors})
    names = frozenset(tensors)
    with stateless._reparametrize_module(model, tensors, strict=_CHECKED_NAMES.get(model) != names):
        _CHECKED_NAMES[model] = names  # the strict check passed (it raises otherwise)
        yield


_CHECKED_NAMES: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every further name of a tied tensor → its first name (``{"lm_head.weight": "model.embed_tokens.weight"}``),
    found once per module: torch's ``tie_weights=True`` walks every parameter at every call."""
    if model not in _ALIASES:
        first: dict[int, str] = {}
        named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
        _ALIASES[model] = {name: first[id(t)] for name, t in named if first.setdefault(id(t), name) != name}
    return _ALIASES[model]


_ALIASES: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _region_tracing() -> Iterator[None]:
    """The torch settings a region's first (compiling) call needs (:func:`d9dfn._torch.region_tracing`: no donated
    backward buffers, floats kept constant, region schemas remembered). Also silenced: dynamo reads ``.grad`` of
    every parameter it traces, and a param cast for compute (a precision policy) is not a leaf, so torch warns that
    its ``.grad`` will not be populated; the gradient goes to the leaf through the cast, as intended. And dynamo's
    own tracing of an autograd function (the per-block gather's) instantiates it, which torch 2.13 deprecates. And
    torch logs, for every graph with a selective checkpoint (the gather's, ``"selective"`` checkpointing), a warning
    that its region must not hold in-place ops: the gather holds none, and ``ActivationCheckpointing`` says so for
    the blocks.
    """
    checkpoint_log = logging.getLogger("torch._higher_order_ops.wrap")
    added = _errors_only not in checkpoint_log.filters  # entered again inside itself: the outer one removes it
    if added:
        checkpoint_log.addFilter(_errors_only)  # not setLevel: that clears every logger's cache, 0.3 ms a call
    try:
        with region_tracing(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
            warnings.filterwarnings("ignore", message=".*autograd.function.Function'> should not be instantiated")
            yield
    finally:
        if added:
            checkpoint_log.removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def region_compile(
    fn: Callable[..., Any], backend: str | Callable[..., Any], prefetch: bool = False
) -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` for a function whose graph holds regions: inductor must
    not reuse buffers (see the module doc), and shapes stay static: after a recompile with new shapes (another step's
    batch, the evaluation's last smaller batch) dynamo would otherwise make them symbolic, and a region then takes its
    block's float constants (the dropout probability) as inputs, which torch 2.13 refuses. With ``prefetch`` the
    graphs' all-gathers are issued one block ahead (:func:`d9dfn.parallel._prefetch.prefetch_gathers`)."""
    options: dict[str, Any] = {}
    if prefetch:
        backend, options = prefetching_backend(cast(str, backend))
    if backend == "inductor":
        options.update(REGION_INDUCTOR_OPTIONS)
    return compile_piece(fn, backend, dynamic=False, options=options or None)


def region_compiled(fn: Callable[..., Any], backend: str | Callable[..., Any] | None) -> Callable[..., Any]:
    """``fn`` (whose graph holds regions: the blockwise tail's) compiled as :func:`region_compile` does, called under
    the settings a region's compile needs (:func:`_region_tracing`); ``fn`` itself when ``backend`` is ``None``."""
    if backend is None:
        return fn
    compiled = region_compile(fn, backend)

    def call(*args: Any, **kwargs: Any) -> Any:
        with _region_tracing():
            return compiled(*args, **kwargs)

    return call


class AutogradVjp:
    """What a regional stage's forward leaves for its backward: its outputs' autograd graph, differentiated
    w.r.t. the param leaves and the inputs (``closure(cotangent)``; ``input`` then ``weight`` split it in two,
    which runs the inner activation gradients twice). The backward runs inside ``during()``: with activation
    checkpointing, the module holding the forward's params again, for the recompute to read."""

    def __init__(
        self,
        primal: Any,
        params: Params,
        inputs: dict[str, torch.Tensor],
        during: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self._primal, self._params, self._inputs, self._during = primal, params, inputs, during
        self._cotangent: Any = None

    def _outputs(self, cotangent: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if isinstance(self._primal, torch.Tensor):
            return [self._primal], [cotangent]
        names = [n for n in self._primal if self._primal[n].requires_grad]
        return [self._primal[n] for n in names], [cotangent[n] for n in names]

    def _grads(self, cotangent: Any, wrt: dict[str, torch.Tensor], retain: bool) -> dict[str, torch.Tensor]:
        if not wrt:
            return {}
        outputs, cotangents = self._outputs(cotangent)
        # First order (no create_graph): silu_backward, not the traced runners' sigmoid form (docs/design/pipeline.md).
        with self._during():
            grads = torch.autograd.grad(outputs, list(wrt.values()), cotangents, retain_graph=retain, allow_unused=True)
        return {n: torch.zeros_like(t) if g is None else g for (n, t), g in zip(wrt.items(), grads, strict=True)}

    def __call__(self, cotangent: Any) -> tuple[Params, dict[str, torch.Tensor]]:
        """``(weight_grads, input_grads)`` in one backward."""
        grads = self._grads(cotangent, {**self._params, **{f"\0{n}": x for n, x in self._inputs.items()}}, False)
        weights = {n: grads[n] for n in self._params}
        return weights, {n: grads[f"\0{n}"] for n in self._inputs}

    def input(self, cotangent: Any) -> dict[str, torch.Tensor]:
        self._cotangent = cotangent
        return self._grads(cotangent, self._inputs, retain=True)

    def weight(self) -> Params:
        return self._grads(self._cotangent, self._params, retain=False)


class RegionalStages:
    """A :class:`~d9dfn.pipeline.StageRunner` that compiles each block class once: every stage (or the whole model
    as one stage) runs as a copy whose blocks are regions, with its params swapped in around one compiled call per
    stage (the forward, and the loss on the last stage), differentiated by autograd.

    Args:
        blocks: the block classes (:func:`resolve_blocks`); an empty tuple compiles each stage whole, still by
            autograd.
        precision: cast the params and inputs to its compute dtype (:func:`d9dfn.step._call.for_compute`).
        backend: the ``torch.compile`` backend; ``None`` runs the same functions eagerly (still via autograd).
        checkpointing: the activation checkpointing of the blocks (:class:`ActivationCheckpointing`), or ``None``.
        block_names: every block's full name, in the whole model's order (which blocks ``checkpointing`` takes).

    With sharded params, :meth:`prepare` makes the blocks whose params the plan stores ``Shard(0)`` over one mesh axis
    gather them per block (:mod:`d9dfn.step._gathered`): the step then hands this runner those params as local shards.
    """

    def __init__(
        self,
        blocks: Sequence[type[nn.Module]],
        precision: Precision | None,
        backend: str | Callable[..., Any] | None,
        checkpointing: ActivationCheckpointing | None = None,
        block_names: Sequence[str] = (),
        prefetch: bool = False,
    ) -> None:
        self.blocks, self.precision, self.backend, self.prefetch = tuple(blocks), precision, backend, prefetch
        self.block_names = tuple(block_names)
        self.gathering = Gathering()
        self.checkpointing = checkpointing
        self.checkpointed = frozenset(
            name
            for index, name in enumerate(block_names)
            if checkpointing is not None and checkpointing.checkpoints(index)
        )
        self.call = stage_call(precision)
        self._classes: RegionClasses = {}  # every stage's blocks of a class share one region
        self._copies: dict[int, nn.Module] = {}
        self._trains: dict[int, Callable[..., Any]] = {}
        self._forwards: dict[int, Callable[..., Any]] = {}

    def for_program(self, program: Program) -> RegionalStages:
        return self

    def prepare(self, plan: ParallelPlan | None, modules: Sequence[nn.Module]) -> frozenset[str]:
        """Plan the per-block gathering from the step's parallel ``plan`` (:func:`d9dfn.step._gathered.plan_gathering`);
        returns the names the step must hand over as local shards. Called when the step is built."""
        if self._copies:
            raise AssertionError("RegionalStages.prepare: call it before the first step")
        wanted = frozenset(self.blocks)
        blocks = {name: sub for m in modules for name, sub in m.named_modules() if type(sub) in wanted}
        self.gathering = plan_gathering(plan, blocks, self.precision)
        return self.gathering.names()

    def _copy(self, stage: Stage) -> nn.Module:
        if stage.index not in self._copies:
            self._copies[stage.index] = with_block_regions(
                stage.module,
                self.blocks,
                self.checkpointed,
                self.checkpointing,
                self.gathering.layouts,
                self._classes,
                inline_gathered=self.prefetch,
            )
        return self._copies[stage.index]

    def _compiled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn if self.backend is None else region_compile(fn, self.backend, self.prefetch)

    @contextlib.contextmanager
    def _swapped(self, stage: Stage, params: Params, buffers: Buffers) -> Iterator[None]:
        """The stage's region copy holding ``params`` and ``buffers`` (the module writes its buffer updates into
        them) for the ``with`` body."""
        compiling = self.checkpointing.compiling() if self.checkpointing is not None else contextlib.nullcontext()
        with swapped_in(self._copy(stage), {**params, **buffers}), _region_tracing(), compiling:
            yield

    def _inputs(self, params: Params, buffers: Buffers) -> tuple[Params, Buffers]:
        """``params`` cast for compute (the gathered blocks' local shards packed into their buckets, which the gather
        casts), and clones of ``buffers`` (a call never writes into the caller's)."""
        params, buckets = self.gathering.buckets(params)
        params, _, _ = for_compute(self.precision, params, {}, {})
        return {**params, **buckets}, {name: b.clone() for name, b in buffers.items()}

    def vjp(
        self, stage: Stage, post: Post, trainable: Params, inputs: dict[str, Any], consts: StageConsts
    ) -> tuple[Any, Any, Any, Buffers]:
        """The stage's forward (and ``post``) on leaves of ``trainable`` and ``inputs``; its backward by autograd.

        ``post`` is taken from the first call for this stage: a runner serves one step function, whose ``post`` for
        a stage is always the same.
        """
        if stage.index not in self._trains:
            precision, module = self.precision, self._copy(stage)

            def train(x: dict[str, Any], c: StageConsts) -> tuple[Any, Any]:
                _, rest, kwargs = for_compute(precision, {}, {**c.rest, **x}, c.kwargs)
                return post(checked_outputs(module, module(**rest, **kwargs)), c)

            self._trains[stage.index] = self._compiled(train)
        leaves = {name: p.detach().requires_grad_() for name, p in trainable.items()}
        xs = {name: x.detach().requires_grad_() for name, x in inputs.items()}
        params, buffers = self._inputs({**leaves, **consts.frozen}, consts.buffers)
        with torch.enable_grad(), self._swapped(stage, params, buffers):
            primal, aux = self._trains[stage.index](xs, consts)
        # A checkpointed block reruns its forward in the backward (eagerly: the compiled backward has its inputs
        # already) and reads the module's params then: the same ones.
        during = functools.partial(self._swapped, stage, params, buffers) if self.checkpointing else None
        return primal, AutogradVjp(primal, leaves, xs, during or contextlib.nullcontext), aux, buffers

    def forward(
        self, stage: Stage, params: Params, buffers: Buffers, inputs: Mapping[str, Any], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The stage's outputs, without gradients (buffer updates are discarded)."""
        if stage.index not in self._forwards:
            precision, module = self.precision, self._copy(stage)

            def forward(x: Mapping[str, Any], kw: Mapping[str, Any]) -> dict[str, Any]:
                _, x, kw = for_compute(precision, {}, x, kw)
                return checked_outputs(module, module(**x, **kw))

            self._forwards[stage.index] = self._compiled(forward)
        with torch.no_grad(), self._swapped(stage, *self._inputs(params, buffers)):
            return self._forwards[stage.index](inputs, kwargs)  # type: ignore[no-any-return]

    def forward_piece(
        self, stage: Stage, consume: Callable[[torch.Tensor, Any, Mapping[str, Any], Any], tuple[Any, Any]]
    ) -> Callable[[tuple[Params, Buffers, torch.Tensor], Any, Any], tuple[Any, Any]]:
        """``piece((params, buffers, step), carry, microbatch)``: the stage's forward and ``consume`` of its outputs,
        compiled as one piece (each block class one region), the params swapped in around it; no gradients. The
        copy is made at the first call (after :meth:`prepare`)."""
        pieces: list[Callable[..., Any]] = []

        def build() -> Callable[..., Any]:
            precision, module = self.precision, self._copy(stage)

            def piece(step: torch.Tensor, carry: Any, microbatch: Any) -> tuple[Any, Any]:
                inputs, kwargs, state = microbatch
                _, inputs, kwargs = for_compute(precision, {}, inputs, kwargs)
                return consume(step, carry, checked_outputs(module, module(**inputs, **kwargs)), state)

            return self._compiled(piece)

        def run(consts: tuple[Params, Buffers, torch.Tensor], carry: Any, microbatch: Any) -> tuple[Any, Any]:
            params, buffers, step = consts
            if not pieces:
                pieces.append(build())
            trainable, frozen, stage_buffers = stage_args(stage, params, buffers)
            with torch.no_grad(), self._swapped(stage, *self._inputs({**trainable, **frozen}, stage_buffers)):
                return pieces[0](step, carry, microbatch)  # type: ignore[no-any-return]

        return run
