"""Fusion passes over the Dynamo FX graph, applied before the graph is split and compiled.

Each pass walks the graph, matches the exact node chain our layers produce (layers/norm.py's
RMSNorm with a residual, layers/activation.py's SiluAndMul), checks that no intermediate value
escapes the chain, and replaces the chain with one fused custom op (passes/fused_ops.py).
A pass returns how many matches it replaced, so tests can prove it fired.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx

import compile.passes.fused_ops  # noqa: F401  (registers the fused ops)


def _is_call(node: object, op: str, target: object) -> bool:
    return isinstance(node, fx.Node) and node.op == op and node.target == target


def _is_method(node: object, name: str) -> bool:
    return _is_call(node, "call_method", name)


def _is_function(node: object, target: object) -> bool:
    return _is_call(node, "call_function", target)


def _only_used_by(node: fx.Node, user: fx.Node) -> bool:
    return set(node.users) == {user}


def _example(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


def _match_add_rms_norm(mul_out: fx.Node) -> dict[str, object] | None:
    """weight * (to(f32(a + b)) * rsqrt(mean(pow(., 2), -1) + eps)).to(dtype)."""
    if not _is_function(mul_out, operator.mul):
        return None
    weight, cast_back = mul_out.args
    if not _is_method(cast_back, "to") or not isinstance(weight, fx.Node):
        return None
    normed = cast_back.args[0]
    if not _is_function(normed, operator.mul):
        return None
    to_f32, rsqrt = normed.args
    if not (_is_method(to_f32, "to") and to_f32.args[1:] == (torch.float32,)):
        return None
    if not _is_function(rsqrt, torch.rsqrt):
        return None
    add_eps = rsqrt.args[0]
    if not _is_function(add_eps, operator.add) or not isinstance(add_eps.args[1], float):
        return None
    mean = add_eps.args[0]
    if not (
        _is_method(mean, "mean") and mean.args[1:] == (-1,) and mean.kwargs == {"keepdim": True}
    ):
        return None
    power = mean.args[0]
    if not (_is_method(power, "pow") and power.args == (to_f32, 2)):
        return None
    summed = to_f32.args[0]
    if not _is_function(summed, operator.add) or len(summed.args) != 2:
        return None
    example = _example(summed)
    if example is None or cast_back.args[1:] != (example.dtype,):
        return None
    chain = (
        (cast_back, mul_out),
        (normed, cast_back),
        (rsqrt, normed),
        (add_eps, rsqrt),
        (mean, add_eps),
        (power, mean),
    )
    if not all(_only_used_by(node, user) for node, user in chain):
        return None
    if set(to_f32.users) != {power, normed}:
        return None
    # Consumers first, so each node is erased after everything that reads it.
    dead = [mul_out, cast_back, normed, rsqrt, add_eps, mean, power, to_f32]
    return {"summed": summed, "weight": weight, "eps": add_eps.args[1], "dead": dead}


def fuse_add_rms_norm(gm: fx.GraphModule) -> int:
    """Replace residual add + RMSNorm with `v1_engine::fused_add_rms_norm`; returns matches."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        match = _match_add_rms_norm(node)
        if match is None:
            continue
        summed = match["summed"]
        x, residual = summed.args
        with graph.inserting_before(node):
            fused = graph.call_function(
                torch.ops.v1_engine.fused_add_rms_norm.default,
                (x, residual, match["weight"], match["eps"]),
            )
            normed = graph.call_function(operator.getitem, (fused, 0))
            new_summed = graph.call_function(operator.getitem, (fused, 1))
        node.replace_all_uses_with(normed)
        _erase(graph, match["dead"])
        summed.replace_all_uses_with(new_summed, delete_user_cb=lambda user, f=fused: user is not f)
        _erase(graph, [summed])
        count += 1
    if count:
        gm.recompile()
    return count


def _erase(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase a replaced chain; never a graph-wide dead-code sweep, which could drop the
    attention op (it returns nothing and only mutates its output)."""
    for node in nodes:
        if not node.users:
            graph.erase_node(node)


def _slice_of(node: object) -> tuple[fx.Node, slice] | None:
    """(x, s) for a node `x[..., s]`."""
    if not _is_function(node, operator.getitem):
        return None
    source, index = node.args
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis):
        return None
    if not isinstance(index[1], slice) or index[1].step is not None:
        return None
    return source, index[1]


def _match_silu_and_mul(mul: fx.Node) -> fx.Node | None:
    """silu(x[..., :h]) * x[..., h:] with x's last dim 2h → x."""
    if not _is_function(mul, operator.mul) or len(mul.args) != 2:
        return None
    silu, up = mul.args
    if not _is_function(silu, F.silu) or silu.kwargs.get("inplace", False):
        return None
    gate, up_slice = _slice_of(silu.args[0]), _slice_of(up)
    if gate is None or up_slice is None or gate[0] is not up_slice[0]:
        return None
    source, half = gate[0], gate[1].stop
    example = _example(source)
    if example is None or not isinstance(half, int) or example.shape[-1] != 2 * half:
        return None
    if gate[1] != slice(None, half, None) or up_slice[1] != slice(half, None, None):
        return None
    if not (_only_used_by(silu, mul) and _only_used_by(silu.args[0], silu)):
        return None
    return source


def fuse_silu_and_mul(gm: fx.GraphModule) -> int:
    """Replace the gated SiLU of the MLP with `v1_engine::silu_and_mul`; returns matches."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        source = _match_silu_and_mul(node)
        if source is None:
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.v1_engine.silu_and_mul.default, (source,))
        node.replace_all_uses_with(fused)
        gate_input, up = node.args[0].args[0], node.args[1]
        _erase(graph, [node, node.args[0], gate_input, up])
        count += 1
    if count:
        gm.recompile()
    return count


FUSION_PASSES: dict[str, Callable[[fx.GraphModule], int]] = {
    "add_rms_norm": fuse_add_rms_norm,
    "silu_and_mul": fuse_silu_and_mul,
}
"""Fusion passes by the name `CompilationConfig.fusion_passes` uses."""
