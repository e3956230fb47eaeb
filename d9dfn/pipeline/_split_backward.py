"""The I/W split of a stage's backward as three FX graphs: ``fw``, ``dI`` and ``dW``, with no duplicated work.

A zero-bubble schedule runs a stage's backward in two halves: ``I`` (the input gradients, which the previous
stage waits for) and, later, ``W`` (the weight gradients, which nobody waits for). ``torch.func.vjp`` computes
both at once, and torch's own split (``torch/distributed/pipelining/_backward.py``) walks the autograd graph, so
it refuses compiled stages (pytorch#161904). This module splits the *traced* backward instead, as torchtitan's
graph-PP ``split_di_dw.py`` does:

1. **Trace the joint.** ``make_fx`` records ``y, vjp_fn = vjp(fn, params, x); vjp_fn(gy)`` as one aten graph
   (real tensors, no decomposition, no functionalization: the same aten calls eager autograd makes, so replaying
   the graph is bitwise equal to ``vjp``).
2. **Partition by the tangent.** Every node that does not depend on the output gradients ``gy`` goes into ``fw``
   (it runs at ``F``; the ones the backward reads are its *residuals*); every node that does goes into the
   backward. Each node runs exactly once.
3. **Split the backward.** ``dI`` holds the backward nodes the input gradients need and also outputs the
   *live-ins*: its values that the rest of the backward reads (the gradients of the intermediates that feed the
   weights). ``dW`` holds every other backward node and reads the residuals, ``gy`` and the live-ins. So
   ``matmuls(dI) + matmuls(dW) = matmuls(full backward)`` (``tests/test_pipeline_split_backward.py`` counts them).
   On stage 0 (no differentiable input) ``dI`` is empty and ``dW`` is the whole backward, as in torch.

The private surface (``make_fx``, FX ``Graph`` surgery) is confined to this module. RNG must be stateless
(d9dfn's ``prng`` keys are inputs); a global-RNG op would be traced with the trace's sample. Graphs are cached
per :class:`SplitBackward` by the structure of the arguments (tree shapes, tensor shapes/dtypes/devices and the
non-tensor leaves), so a step traces each stage once whatever the microbatch count.

**Compiled pieces.** ``SplitBackward(compile=...)`` hands each traced graph (``fw``, ``dI``, ``dW``) to a compiler
once, when it is traced (``make_train_step(compile=True)`` passes ``torch.compile(fullgraph=True)`` with the step's
backend), and the pieces then run compiled for every microbatch and step: each distinct piece is compiled once, so
the graph count does not grow with the microbatch count. A compiled piece equals the eager one to rounding only
(inductor fuses and reorders); the uncompiled graphs stay bitwise equal to ``vjp``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.func import vjp
from torch.fx.experimental.proxy_tensor import make_fx

from d9dfn._tracing import tracing_for_replay

__all__ = ["SplitBackward", "SplitGraphs", "SplitVjp", "split_joint"]


@dataclass(frozen=True)
class SplitGraphs:
    """One stage's three graphs.

    Attributes:
        fw: ``fw(*primals) -> (*outputs, *residuals)``.
        d_input: ``dI(*residuals_I, *tangents_I) -> (*input_grads, *live)``.
        d_weight: ``dW(*residuals_W, *tangents_W, *live) -> weight_grads``.
        num_outputs: how many leading outputs of ``fw`` are the function's outputs.
        input_residuals, input_tangents: indices into the residuals and tangents that ``dI`` reads.
        weight_residuals, weight_tangents: the same for ``dW``.
        full: the joint graph as traced (for counting and debugging).
    """

    fw: fx.GraphModule
    d_input: fx.GraphModule
    d_weight: fx.GraphModule
    num_outputs: int
    input_residuals: tuple[int, ...]
    input_tangents: tuple[int, ...]
    weight_residuals: tuple[int, ...]
    weight_tangents: tuple[int, ...]
    full: fx.GraphModule


def _subgraph(
    graph: fx.Graph, inputs: list[fx.Node], nodes: list[fx.Node], outputs: list[fx.Node], owner: torch.nn.Module
) -> fx.GraphModule:
    """A graph whose placeholders are ``inputs``, computing ``nodes`` (in graph order) and returning ``outputs``."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = new.placeholder(f"in{i}")
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
    new.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(owner, new)


def split_joint(
    joint: fx.GraphModule, num_primals: int, num_tangents: int, num_outputs: int, num_input_grads: int
) -> SplitGraphs:
    """Split a traced joint graph ``(*primals, *tangents) -> (*outputs, *input_grads, *weight_grads)``.

    Args:
        joint: the ``make_fx`` trace; its placeholders are the primals, then the tangents.
        num_primals: how many leading placeholders are primals (params, inputs, constants alike).
        num_tangents: how many trailing placeholders are the output gradients.
        num_outputs: how many leading graph outputs are the function's outputs (incl. non-differentiable aux).
        num_input_grads: how many outputs after them are the input gradients; the rest are weight gradients.
    """
    graph = joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    (output_node,) = (n for n in graph.nodes if n.op == "output")
    flat_out = list(pytree.tree_leaves(output_node.args[0]))
    if len(placeholders) != num_primals + num_tangents:
        raise AssertionError(f"split_joint: {len(placeholders)} placeholders, expected {num_primals}+{num_tangents}")
    primals, tangents = placeholders[:num_primals], placeholders[num_primals:]
    outputs = flat_out[:num_outputs]
    input_grads = flat_out[num_outputs : num_outputs + num_input_grads]
    weight_grads = flat_out[num_outputs + num_input_grads :]
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]

    # 1. Backward = every node that depends on a tangent; forward = every other node (side effects included).
    backward: set[fx.Node] = set(tangents)
    for node in body:
        if any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    fw_nodes = [n for n in body if n not in backward]
    bw_nodes = [n for n in body if n in backward]

    # 2. dI = the backward nodes the input gradients need; dW = the rest of the backward.
    needed: set[fx.Node] = set()
    stack = [n for n in input_grads if n in backward]
    while stack:
        node = stack.pop()
        if node in needed or node.op == "placeholder":
            continue
        needed.add(node)
        stack.extend(a for a in node.all_input_nodes if a in backward)
    di_nodes = [n for n in bw_nodes if n in needed]
    dw_nodes = [n for n in bw_nodes if n not in needed]
    di_set, dw_set = set(di_nodes), set(dw_nodes)

    def reads(nodes: list[fx.Node], extra: list[fx.Node]) -> list[fx.Node]:
        seen: dict[fx.Node, None] = {}
        inside = set(nodes)
        for node in [*nodes, *extra]:
            for arg in node.all_input_nodes if node in inside else [node]:
                if arg not in inside:
                    seen[arg] = None
        return list(seen)

    fw_set = set(fw_nodes) | set(primals)
    di_reads = reads(di_nodes, input_grads)
    dw_reads = reads(dw_nodes, weight_grads)
    live = [n for n in dw_reads if n in di_set]
    residuals = list(dict.fromkeys(n for n in [*di_reads, *dw_reads] if n in fw_set))
    index = {n: i for i, n in enumerate(residuals)}
    tangent_index = {n: i for i, n in enumerate(tangents)}
    di_res = [n for n in di_reads if n in index]
    di_tan = [n for n in di_reads if n in tangent_index]
    dw_res = [n for n in dw_reads if n in index]
    dw_tan = [n for n in dw_reads if n in tangent_index]
    unknown = [n for n in [*di_reads, *dw_reads] if n not in index and n not in tangent_index and n not in di_set]
    if unknown or any(n in dw_set for n in di_reads):
        raise AssertionError(f"split_joint: the backward reads nodes outside fw/dI: {unknown[:3]}")
    return SplitGraphs(
        fw=_subgraph(graph, primals, fw_nodes, [*outputs, *residuals], joint),
        d_input=_subgraph(graph, [*di_res, *di_tan], di_nodes, [*input_grads, *live], joint),
        d_weight=_subgraph(graph, [*dw_res, *dw_tan, *live], dw_nodes, weight_grads, joint),
        num_outputs=len(outputs),
        input_residuals=tuple(index[n] for n in di_res),
        input_tangents=tuple(tangent_index[n] for n in di_tan),
        weight_residuals=tuple(index[n] for n in dw_res),
        weight_tangents=tuple(tangent_index[n] for n in dw_tan),
        full=joint,
    )


def _key_of(leaf: Any) -> Hashable:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))  # unhashable constant: no reuse (still correct)
    return ("const", type(leaf), leaf)


Compiler = Callable[[fx.GraphModule], Callable[..., Any]]
"""Turns one traced piece into the callable that runs it (``torch.compile(gm, ...)``); called once per piece."""


@dataclass
class _Traced:
    graphs: SplitGraphs
    fw: Callable[..., Any]  # graphs.fw, or its compiled form (the same for d_input / d_weight)
    d_input: Callable[..., Any]
    d_weight: Callable[..., Any]
    out_spec: pytree.TreeSpec
    out_consts: list[Any]  # per output leaf: the constant, or a marker for a tensor
    out_is_tensor: list[bool]
    primal_spec: pytree.TreeSpec
    num_params: int
    params_spec: pytree.TreeSpec
    inputs_spec: pytree.TreeSpec


_TENSOR = object()


class SplitVjp:
    """What ``F`` leaves for one (stage, microbatch): the residuals, then ``input`` (I) and ``weight`` (W)."""

    def __init__(self, traced: _Traced, residuals: list[torch.Tensor]) -> None:
        self._traced = traced
        self._residuals: list[torch.Tensor] | None = residuals
        self._tangents: list[torch.Tensor] | None = None
        self._live: list[torch.Tensor] | None = None

    def input(self, cotangent: Any) -> Any:
        """Run ``dI``: the input gradients (same tree as the differentiable inputs); keeps the live-ins for W."""
        g, res = self._traced.graphs, self._residuals
        if res is None:
            raise RuntimeError("SplitVjp.input: weight (W) already ran")
        tangents = list(pytree.tree_leaves(cotangent))
        out = self._traced.d_input(*(res[i] for i in g.input_residuals), *(tangents[i] for i in g.input_tangents))
        num_inputs = self._traced.inputs_spec.num_leaves
        self._tangents, self._live = tangents, list(out[num_inputs:])
        return pytree.tree_unflatten(list(out[:num_inputs]), self._traced.inputs_spec)

    def weight(self) -> Any:
        """Run ``dW`` from the residuals and the live-ins: the weight gradients (same tree as the params)."""
        g, res, tangents, live = self._traced.graphs, self._residuals, self._tangents, self._live
        if res is None or tangents is None or live is None:
            raise RuntimeError("SplitVjp.weight: run input (I) first, and weight (W) once")
        out = self._traced.d_weight(
            *(res[i] for i in g.weight_residuals), *(tangents[i] for i in g.weight_tangents), *live
        )
        self._residuals = self._tangents = self._live = None  # free at last use
        return pytree.tree_unflatten(list(out), self._traced.params_spec)

    def __call__(self, cotangent: Any) -> tuple[Any, Any]:
        """The full backward ``(weight_grads, input_grads)``, as ``vjp``'s closure returns them."""
        input_grads = self.input(cotangent)
        return self.weight(), input_grads


class SplitBackward:
    """``vjp`` with a backward split into I and W; graphs traced once per argument structure (a cache).

    ``fn(params, inputs, consts) -> (primal, aux)``: differentiate w.r.t. ``params`` and ``inputs`` (trees of
    floating tensors); ``consts`` (any tree: buffers, kwargs, state) is not differentiated; ``aux`` is any tree.
    The cache is keyed by ``key`` (the caller names the function) and the argument structure: the same ``key``
    must mean the same function.

    Args:
        compile: called once on each traced piece (``fw``, ``dI``, ``dW``) to get the callable that runs it, e.g.
            ``lambda gm: torch.compile(gm, fullgraph=True)``; ``None`` replays the graphs as they are (bitwise
            equal to ``vjp``).
    """

    def __init__(self, compile: Compiler | None = None) -> None:
        self._cache: dict[Hashable, _Traced] = {}
        self._compile = compile

    @property
    def compiles(self) -> bool:
        """Whether the pieces run compiled (then every backward form should go through them)."""
        return self._compile is not None

    def __len__(self) -> int:
        return len(self._cache)

    def _trace(self, fn: Callable[..., Any], params: Any, inputs: Any, consts: Any) -> _Traced:
        flat_p, p_spec = pytree.tree_flatten(params)
        flat_x, x_spec = pytree.tree_flatten(inputs)
        flat_c, c_spec = pytree.tree_flatten(consts)
        tensor_c = [i for i, leaf in enumerate(flat_c) if isinstance(leaf, torch.Tensor)]
        with torch.no_grad():  # the output gradients' shapes (one extra forward per trace)
            primal_like, _ = fn(params, inputs, consts)
        flat_y, y_spec = pytree.tree_flatten(primal_like)
        box: dict[str, Any] = {}

        def joint(*flat: torch.Tensor) -> list[torch.Tensor]:
            n_p, n_x, n_c = len(flat_p), len(flat_x), len(tensor_c)
            p = pytree.tree_unflatten(list(flat[:n_p]), p_spec)
            x = pytree.tree_unflatten(list(flat[n_p : n_p + n_x]), x_spec)
            c_leaves = list(flat_c)
            for j, i in enumerate(tensor_c):
                c_leaves[i] = flat[n_p + n_x + j]
            c = pytree.tree_unflatten(c_leaves, c_spec)
            tangents = pytree.tree_unflatten(list(flat[n_p + n_x + n_c :]), y_spec)

            def inner(p_: Any, x_: Any) -> tuple[Any, list[Any]]:
                primal_, aux_ = fn(p_, x_, c)
                aux_leaves, box["aux_spec"] = pytree.tree_flatten(aux_)
                box["aux_leaves"] = aux_leaves
                return primal_, [leaf for leaf in aux_leaves if isinstance(leaf, torch.Tensor)]

            primal, vjp_fn, aux_tensors = vjp(inner, p, x, has_aux=True)  # type: ignore[misc]  # the stub omits has_aux
            # create_graph=True: the backward formulas torch.func.grad_and_value (the one-stage step) records; the
            # trace runs under enable_grad too, so this only spells it out (docs/design/pipeline.md).
            grad_p, grad_x = vjp_fn(tangents, create_graph=True)
            it = iter(aux_tensors)
            aux_leaves = [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in box["aux_leaves"]]
            aux = pytree.tree_unflatten(aux_leaves, box["aux_spec"])
            out_leaves, out_spec = pytree.tree_flatten((primal, aux))
            box["out_spec"] = out_spec
            box["is_tensor"] = [isinstance(leaf, torch.Tensor) for leaf in out_leaves]
            box["consts"] = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
            tensors = [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)]
            box["num_outputs"] = len(tensors)
            return [*tensors, *pytree.tree_leaves(grad_x), *pytree.tree_leaves(grad_p)]

        example = [*flat_p, *flat_x, *(flat_c[i] for i in tensor_c), *(torch.ones_like(y) for y in flat_y)]
        with torch.enable_grad(), tracing_for_replay():  # shapes that follow data would be the example's forever
            gm = make_fx(joint, tracing_mode="real")(*example)
        graphs = split_joint(
            gm,
            num_primals=len(flat_p) + len(flat_x) + len(tensor_c),
            num_tangents=len(flat_y),
            num_outputs=box["num_outputs"],
            num_input_grads=len(flat_x),
        )
        run = self._compile or (lambda gm: gm)
        return _Traced(
            graphs,
            run(graphs.fw),
            run(graphs.d_input),
            run(graphs.d_weight),
            box["out_spec"],
            box["consts"],
            box["is_tensor"],
            y_spec,
            len(flat_p),
            p_spec,
            x_spec,
        )

    def __call__(
        self, key: Hashable, fn: Callable[..., Any], params: Any, inputs: Any, consts: Any
    ) -> tuple[Any, SplitVjp, Any]:
        """``(primal, split_vjp, aux)``: run ``fw`` now; ``split_vjp.input`` / ``.weight`` later."""
        flat_p, p_spec = pytree.tree_flatten(params)
        flat_x, x_spec = pytree.tree_flatten(inputs)
        flat_c, c_spec = pytree.tree_flatten(consts)
        cache_key = (key, p_spec, x_spec, c_spec, *map(_key_of, flat_p), *map(_key_of, flat_x), *map(_key_of, flat_c))
        traced = self._cache.get(cache_key)
        if traced is None:
            traced = self._cache[cache_key] = self._trace(fn, params, inputs, consts)
        g = traced.graphs
        tensors_c = [leaf for leaf in flat_c if isinstance(leaf, torch.Tensor)]
        out = traced.fw(*flat_p, *flat_x, *tensors_c)
        outputs, residuals = iter(out[: g.num_outputs]), list(out[g.num_outputs :])
        leaves = [next(outputs) if is_t else c for is_t, c in zip(traced.out_is_tensor, traced.out_consts, strict=True)]
        primal, aux = pytree.tree_unflatten(leaves, traced.out_spec)
        return primal, SplitVjp(traced, residuals), aux
