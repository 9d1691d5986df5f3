"""Cutting a Dynamo graph at the splitting ops (the attention custom ops).

Dynamo traces the whole model into one FX graph. Every splitting-op node goes into a
submodule of its own; the nodes between two of them form a piece:

    piece 0 ─ kv_cache_update(L0) ─ attention(L0) ─ piece 1 ─ kv_cache_update(L1) ─ ...
    (embed, norm,                                   (o_proj, MLP, norm,
     qkv, RoPE of L0)                                qkv, RoPE of L1)

The pieces hold no layer name: the names are constants of the op nodes, which sit in the
splitting submodules. So all middle pieces are the same graph, and `structure_key` lets
the backend compile it once for all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module


@dataclass
class SplitItem:
    """One submodule of the split graph, in execution order."""

    name: str
    """Its attribute name in the split GraphModule ("submod_3")."""
    is_splitting_op: bool
    """True: it only calls a splitting op, which runs eagerly. False: a piece to compile."""
    graph: fx.GraphModule


def resolve_splitting_ops(names: Sequence[str]) -> list[str]:
    """Check that every entry of `CompilationConfig.splitting_ops` names a registered op."""
    for name in names:
        namespace, sep, op = name.partition("::")
        if not (sep and namespace and op and hasattr(getattr(torch.ops, namespace), op)):
            raise ValueError(
                f"splitting_ops entry {name!r} is not a registered torch op; use 'namespace::op', "
                "e.g. 'pagedkv::unified_attention_with_output' (registered when pagedkv.attention is imported)."
            )
    return list(names)


def op_name(target: Any) -> str | None:
    """'namespace::op' of an op-call target (packet or overload), None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def split_graph(graph: fx.GraphModule, splitting_ops: Sequence[str]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split `graph` before and after every call of an op in `splitting_ops`.

    Returns the stitching GraphModule (its `submod_<i>` attributes, called in order) and
    the submodules in execution order. Empty stretches (two splitting ops back to back)
    make no piece.
    """
    wanted = set(splitting_ops)
    part_of: dict[fx.Node, int] = {}
    splitting_parts: set[int] = set()
    part = 0
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and op_name(node.target) in wanted:
            # A part of its own, and whatever follows starts a new one.
            part += 1
            splitting_parts.add(part)
            part_of[node] = part
            part += 1
        else:
            part_of[node] = part
    # keep_original_order: the attention op writes into a buffer made in the piece before
    # it (mutation), so nodes must not be regrouped out of program order. The root module
    # argument is unused by torch (vLLM passes None); `graph` is what it names.
    split = split_module(graph, graph, lambda node: part_of[node], keep_original_order=True)
    items = []
    for name, module in split.named_children():
        assert isinstance(module, fx.GraphModule)  # split_module makes every submod_<i> a GraphModule
        items.append(SplitItem(name, int(name.removeprefix("submod_")) in splitting_parts, module))
    items.sort(key=lambda item: int(item.name.removeprefix("submod_")))
    return split, items


def structure_key(graph: fx.GraphModule, example_args: Sequence[Any]) -> tuple[Any, ...]:
    """What decides a compiled piece: its nodes (names abstracted away) and its inputs'
    shapes, strides and dtypes. Two pieces with equal keys can share one compiled callable:
    weights are graph inputs, and anything read from an attribute keeps its name in the key.
    """
    index: dict[fx.Node, str] = {}
    nodes = []
    for i, node in enumerate(graph.graph.nodes):
        index[node] = f"%{i}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        if node.op == "placeholder":
            target = ""  # an input's name (after the layer it came from) is not its meaning
        elif isinstance(node.target, str):
            target = node.target
        else:
            target = fx.node._get_qualified_name(node.target)
        nodes.append((node.op, target, repr(args)))
    return tuple(nodes), tuple(_describe(arg) for arg in example_args)


def _describe(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return ("tensor", tuple(map(str, arg.shape)), tuple(map(str, arg.stride())), arg.dtype, arg.device.type)
    return (type(arg).__name__, str(arg))
