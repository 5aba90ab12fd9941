"""Fusion passes over the Dynamo FX graph, applied before the graph is split and compiled.

Each pass walks the graph, matches the exact node chain our layers produce (layers/norm.py's
RMSNorm with a residual, layers/activation.py's SiluAndMul), checks that no intermediate value
escapes the chain, and replaces the chain with one fused custom op (passes/fused_ops.py).
A pass returns how many matches it replaced, so tests can prove it fired.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

# Imported for its side effect: registering the fused ops the passes insert.
import compile.passes.fused_ops  # noqa: F401


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


def _is_op(node: object, packet: torch._ops.OpOverloadPacket) -> bool:
    """A call of the custom op `packet` (Dynamo records the packet, our passes the overload)."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and (node.target is packet or node.target is packet.default)
    )


def _outputs_by_index(node: fx.Node) -> dict[int, list[fx.Node]] | None:
    """The getitem users of a tuple-returning node by index; None if anything else reads it."""
    outputs: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if not (_is_function(user, operator.getitem) and isinstance(user.args[1], int)):
            return None
        outputs.setdefault(user.args[1], []).append(user)
    return outputs


def _match_rms_norm(mul_out: fx.Node) -> dict[str, object] | None:
    """weight * (to(f32(x)) * rsqrt(mean(pow(., 2), -1) + eps)).to(x.dtype), layers/norm.py's
    chain; returns its input x, weight, eps and the nodes it leaves dead once replaced."""
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
    source = to_f32.args[0]
    example = _example(source) if isinstance(source, fx.Node) else None
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
    return {"input": source, "weight": weight, "eps": add_eps.args[1], "dead": dead}


def _match_add_rms_norm(mul_out: fx.Node) -> dict[str, object] | None:
    """The RMSNorm chain applied to a residual sum `a + b`."""
    match = _match_rms_norm(mul_out)
    if match is None:
        return None
    summed = match["input"]
    if not _is_function(summed, operator.add) or len(summed.args) != 2:
        return None
    return {**match, "summed": summed}


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
        # Later passes (the FP8 quant fusions) read shapes and dtypes off the new nodes.
        _copy_example(node, normed)
        _copy_example(summed, new_summed)
        node.replace_all_uses_with(normed)
        _erase(graph, match["dead"])
        summed.replace_all_uses_with(new_summed, delete_user_cb=lambda user, f=fused: user is not f)
        _erase(graph, [summed])
        count += 1
    if count:
        gm.recompile()
    return count


def _copy_example(old: fx.Node, new: fx.Node) -> None:
    if "example_value" in old.meta:
        new.meta["example_value"] = old.meta["example_value"]


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
        _copy_example(node, fused)
        node.replace_all_uses_with(fused)
        gate_input, up = node.args[0].args[0], node.args[1]
        _erase(graph, [node, node.args[0], gate_input, up])
        count += 1
    if count:
        gm.recompile()
    return count


# ---- skinny GEMM epilogues -------------------------------------------------------------------
#
# An unquantized linear layer on CUDA is `v1_engine::skinny_linear(x, weight, bias)`
# (kernels/triton_gemv.py). When its output is read by nothing but a SiLU-and-mul or a residual
# add + RMSNorm (the base passes' fused ops), GEMM and op become one op whose CUDA body runs the
# op as the GEMM's epilogue (kernels/skinny_epilogues.py). Each pass first runs its base pass.


def _skinny_linear_args(node: object) -> tuple[fx.Node, fx.Node] | None:
    """(x, weight) of a `v1_engine::skinny_linear(x, weight)` call with no bias and 2-D x."""
    packet = getattr(torch.ops.v1_engine, "skinny_linear", None)
    if packet is None or not _is_op(node, packet):
        return None
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    example = _example(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if bias is not None or example is None or example.dim() != 2:
        return None
    return node.args[0], node.args[1]


def _fuse_into_skinny(
    gm: fx.GraphModule, consumer: torch._ops.OpOverloadPacket, fused_op: torch._ops.OpOverload
) -> int:
    """Every `consumer(skinny_linear(x, w), *rest)` whose GEMM output nothing else reads =>
    `fused_op(x, w, *rest)`; returns matches."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if not _is_op(node, consumer):
            continue
        linear, *rest = node.args
        operands = _skinny_linear_args(linear)
        if operands is None or not _only_used_by(linear, node):
            continue
        with graph.inserting_before(node):
            fused = graph.call_function(fused_op, (*operands, *rest))
        _copy_example(node, fused)
        node.replace_all_uses_with(fused)
        _erase(graph, [node, linear])
        count += 1
    if count:
        gm.recompile()
    return count


def fuse_skinny_silu_mul(gm: fx.GraphModule) -> int:
    """skinny_linear(x, gate_up) -> silu_and_mul => `v1_engine::skinny_linear_silu_mul`;
    runs fuse_silu_and_mul first. Returns matches."""
    fuse_silu_and_mul(gm)
    ops = torch.ops.v1_engine
    return _fuse_into_skinny(gm, ops.silu_and_mul, ops.skinny_linear_silu_mul.default)


def fuse_skinny_add_rms_norm(gm: fx.GraphModule) -> int:
    """skinny_linear(x, w) -> fused_add_rms_norm(., residual, norm_w, eps) =>
    `v1_engine::skinny_linear_add_rms_norm`; runs fuse_add_rms_norm first. Returns matches."""
    fuse_add_rms_norm(gm)
    ops = torch.ops.v1_engine
    return _fuse_into_skinny(gm, ops.fused_add_rms_norm, ops.skinny_linear_add_rms_norm.default)


def _read_between(values: list[fx.Node], start: fx.Node, end: fx.Node) -> bool:
    """Whether a node strictly between `start` and `end` in graph order reads any of `values`
    (an op inserted at `end` that defines them would come after such a reader)."""
    readers = {user for value in values for user in value.users}
    node = start.next
    while node is not end and node.op != "root":
        if node in readers:
            return True
        node = node.next
    return False


def _fold_norm_into(
    graph: fx.Graph,
    consumer: fx.Node,
    op: torch._ops.OpOverload,
    args: tuple,
    sums: list[fx.Node],
    dead: list[fx.Node],
) -> None:
    """Replace `consumer` (a GEMM reading a norm's output) by `op(*args)` -> (out, residual sum):
    its readers take out, the readers of the norm's residual sums (`sums`) the sum; then erase
    consumer, `dead` (the nodes between, users first) and the sums."""
    with graph.inserting_before(consumer):
        fused = graph.call_function(op, args)
        out = graph.call_function(operator.getitem, (fused, 0))
        summed = graph.call_function(operator.getitem, (fused, 1))
    _copy_example(consumer, out)
    consumer.replace_all_uses_with(out)
    for old in sums:
        _copy_example(old, summed)
        old.replace_all_uses_with(summed)
    _erase(graph, [consumer, *dead[:-1], *sums, dead[-1]])


def fuse_skinny_norm_linear(gm: fx.GraphModule) -> int:
    """fused_add_rms_norm(x, r, w, eps) whose normed output feeds only skinny_linear(., W) (no
    bias) or skinny_linear_silu_mul(., W) => `v1_engine::skinny_add_norm_linear(x, r, w, eps, W,
    gated)`, the residual sum its second output (x 2-D, nothing between the two reading that
    sum). Runs fuse_add_rms_norm first; after skinny_silu_mul to see the gated form. Returns
    matches."""
    fuse_add_rms_norm(gm)
    ops = torch.ops.v1_engine
    graph, count = gm.graph, 0
    for norm in list(graph.nodes):
        if not _is_op(norm, ops.fused_add_rms_norm) or len(norm.args) != 4 or norm.kwargs:
            continue
        outputs = _outputs_by_index(norm)
        normed = (outputs or {}).get(0, [])
        if outputs is None or len(normed) != 1 or len(normed[0].users) != 1:
            continue
        (consumer,) = normed[0].users
        if _is_op(consumer, ops.skinny_linear_silu_mul) and len(consumer.args) == 2:
            gated = True
        elif _skinny_linear_args(consumer) is not None:
            gated = False
        else:
            continue
        x = norm.args[0]
        example = _example(x) if isinstance(x, fx.Node) else None
        sums = outputs.get(1, [])
        if consumer.args[0] is not normed[0] or example is None or example.dim() != 2:
            continue
        if _read_between(sums, norm, consumer):
            continue
        args = (*norm.args, consumer.args[1], gated)
        _fold_norm_into(graph, consumer, ops.skinny_add_norm_linear.default, args, sums,
                        [normed[0], norm])  # fmt: skip
        count += 1
    if count:
        gm.recompile()
    return count


def _gated_source(h: object, down: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(x, w_gate_up, nodes) when `h`, read by `down` alone, is `skinny_linear_silu_mul(x, w)`
    or `silu_and_mul(skinny_linear(x, w))` (the nodes to erase, users first)."""
    ops = torch.ops.v1_engine
    if not isinstance(h, fx.Node) or not _only_used_by(h, down):
        return None
    if _is_op(h, ops.skinny_linear_silu_mul):
        x, w = h.args[:2]
        return x, w, [h]
    if _is_op(h, ops.silu_and_mul):
        operands = _skinny_linear_args(h.args[0])
        if operands is not None and _only_used_by(h.args[0], h):
            return *operands, [h, h.args[0]]
    return None


def fuse_mlp(gm: fx.GraphModule) -> int:
    """gate_up GEMM -> SiLU-and-mul -> down GEMM -> residual add + RMSNorm (skinny_linear ops and
    the base passes' fused ops, or the gated skinny op) => `v1_engine::fused_mlp_add_rms_norm`,
    one persistent kernel at the decode sizes kernels/triton_mlp.py's table holds. Runs the base
    passes first. Returns matches."""
    fuse_silu_and_mul(gm)
    fuse_add_rms_norm(gm)
    ops = torch.ops.v1_engine
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if not _is_op(node, ops.fused_add_rms_norm):
            continue
        down, residual, norm_weight, eps = node.args
        operands = _skinny_linear_args(down)
        if operands is None or not _only_used_by(down, node):
            continue
        gated = _gated_source(operands[0], down)
        if gated is None:
            continue
        x, w_gate_up, gate_nodes = gated
        with graph.inserting_before(node):
            fused = graph.call_function(
                ops.fused_mlp_add_rms_norm.default,
                (x, w_gate_up, operands[1], residual, norm_weight, eps),
            )
        _copy_example(node, fused)
        node.replace_all_uses_with(fused)
        _erase(graph, [node, down, *gate_nodes])
        count += 1
    if count:
        gm.recompile()
    return count


# ---- rotary embedding into the attention op --------------------------------------------------
#
# layers/rotary.py rotates query and key with `v1_engine::rotary_embedding` (on CUDA), and the
# attention op then writes the rotated key and the value to the cache before attending. When the
# rotated tensors are read by nothing but one attention call (through the layer's reshapes, and
# the `empty_like` that shapes its output buffer), the rotation moves into the attention op
# (layers/attention.py: its positions / rotary-table arguments), whose Triton backend rotates
# and writes the cache in one kernel.

_ALIAS_METHODS = ("reshape", "view")


def _rotated_reads_ok(node: fx.Node, attention: fx.Node) -> bool:
    """Whether every reader of `node` (a rotated query or key), seen through reshapes / views,
    is `attention` or an `empty_like` (which reads only the shape, the same before rotation)."""
    for user in node.users:
        if user is attention or _is_function(user, torch.empty_like):
            continue
        aliased = user.op == "call_method" and user.target in _ALIAS_METHODS
        if not (aliased and _rotated_reads_ok(user, attention)):
            return False
    return True


def _source_through_aliases(node: object) -> object:
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _ALIAS_METHODS:
        node = node.args[0]
    return node


def fuse_rope_kv_cache(gm: fx.GraphModule) -> int:
    """rotary_embedding(positions, q, k, cos, sin, neox) -> unified_attention(q', k', v, out,
    name) => unified_attention(q, k, v, out, name, positions, cos, sin, neox). Returns matches."""
    rope = getattr(torch.ops.v1_engine, "rotary_embedding", None)
    attention = getattr(torch.ops.v1_engine, "unified_attention", None)
    if rope is None or attention is None:
        return 0
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if not _is_op(node, attention) or len(node.args) != 5 or node.kwargs:
            continue
        rotated = [_source_through_aliases(arg) for arg in node.args[:2]]
        if not all(_is_function(r, operator.getitem) for r in rotated):
            continue
        source = rotated[0].args[0]
        if not _is_op(source, rope) or rotated[1].args[0] is not source:
            continue
        if (rotated[0].args[1], rotated[1].args[1]) != (0, 1) or source.kwargs:
            continue
        outputs = _outputs_by_index(source)
        if outputs is None or outputs.get(0) != [rotated[0]] or outputs.get(1) != [rotated[1]]:
            continue
        if not all(_rotated_reads_ok(r, node) for r in rotated):
            continue
        positions, query, key, cos_cache, sin_cache, is_neox_style = source.args
        for old, new in zip(rotated, (query, key)):
            old.replace_all_uses_with(new)
        node.args = (*node.args, positions, cos_cache, sin_cache, is_neox_style)
        _erase(graph, [*rotated, source])
        count += 1
    if count:
        gm.recompile()
    return count
