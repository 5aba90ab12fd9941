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

# Imported for their side effect: registering the fused ops the passes insert.
import compile.passes.fp8_linear_ops
import compile.passes.fused_ops
import compile.passes.fused_quant_ops  # noqa: F401


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


# ---- FP8 activation-quant fusions ------------------------------------------------------------
#
# An FP8 linear layer (layers/quantization/fp8.py) quantizes its input with
# `per_token_fp8_quant(x.reshape(-1, K))` (or `per_token_group_fp8_quant(..., 128)` for block
# checkpoints). When that input is an RMSNorm or SiLU-and-mul output read by nothing else, the
# two become one fused op (passes/fused_quant_ops.py) and the high-precision activation is never
# written. Each FP8 pass first runs its base pass (fuse_add_rms_norm / fuse_silu_and_mul: the
# second run of a pass finds nothing, so the order of the configured names does not matter) and
# then matches the base pass's fused op, plus the plain RMSNorm chain (the first layer's input
# norm, which has no residual), feeding the quant.

_QUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _is_op(node: object, packet: torch._ops.OpOverloadPacket) -> bool:
    """A call of the custom op `packet` (Dynamo records the packet, our passes the overload)."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and (node.target is packet or node.target is packet.default)
    )


def _quant_group_size(quant: fx.Node) -> tuple[bool, int | None]:
    """(is an activation quant node, its group size: None = per token)."""
    if _is_op(quant, torch.ops.v1_engine.per_token_fp8_quant) and len(quant.args) == 1:
        return True, None
    if _is_op(quant, torch.ops.v1_engine.per_token_group_fp8_quant) and len(quant.args) == 2:
        group_size = quant.args[1]
        return isinstance(group_size, int), group_size
    return False, None


def _outputs_by_index(node: fx.Node) -> dict[int, list[fx.Node]] | None:
    """The getitem users of a tuple-returning node by index; None if anything else reads it."""
    outputs: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if not (_is_function(user, operator.getitem) and isinstance(user.args[1], int)):
            return None
        outputs.setdefault(user.args[1], []).append(user)
    return outputs


def _match_quant(quant: fx.Node) -> dict[str, object] | None:
    """A per-token(-group) quant whose input, seen through the layers' `reshape(-1, K)`, is read
    by nothing else: returns that input ("source"), the flatten node (or None), group size."""
    is_quant, group_size = _quant_group_size(quant)
    if not is_quant or _outputs_by_index(quant) is None:
        return None
    source, flatten = quant.args[0], None
    if not isinstance(source, fx.Node):
        return None
    if _is_method(source, "reshape") or _is_method(source, "view"):
        inner = source.args[0]
        example = _example(inner) if isinstance(inner, fx.Node) else None
        if example is None or example.dim() < 1 or source.kwargs:
            return None
        if source.args[1:] != (-1, example.shape[-1]) or not _only_used_by(source, quant):
            return None
        source, flatten = inner, source
    example = _example(source)
    if example is None or example.dtype not in _QUANT_DTYPES:
        return None
    if not _only_used_by(source, quant if flatten is None else flatten):
        return None
    return {"source": source, "flatten": flatten, "group_size": group_size}


def _fused_quant_op(name: str, group_size: int | None) -> torch._ops.OpOverload:
    kind = "per_token" if group_size is None else "per_token_group"
    return getattr(torch.ops.v1_engine, f"{name}_{kind}_fp8_quant").default


def _replace_quant(
    graph: fx.Graph, match: dict[str, object], anchor: fx.Node, op_name: str, args: tuple
) -> fx.Node:
    """Insert the fused op before `anchor` (after its inputs, before every reader of what it
    replaces) and route the quant's (q, scales) readers to its outputs."""
    quant, flatten, group_size = match["quant"], match["flatten"], match["group_size"]
    if group_size is not None:
        args = (*args, group_size)
    with graph.inserting_before(anchor):
        fused = graph.call_function(_fused_quant_op(op_name, group_size), args)
        q = graph.call_function(operator.getitem, (fused, 0))
        scales = graph.call_function(operator.getitem, (fused, 1))
        unflattened = (q, scales)
        if flatten is not None:
            width = _example(match["source"]).shape[-1]
            num_scales = 1 if group_size is None else -(-width // group_size)
            q = graph.call_method("reshape", (q, -1, width))
            scales = graph.call_method("reshape", (scales, -1, num_scales))
    for index, users in _outputs_by_index(quant).items():
        for user in users:
            # Later passes (the FP8 decode ops) read shapes off the new nodes; a 2-D source's
            # outputs have the flattened shapes already.
            _copy_example(user, (q, scales)[index])
            if flatten is not None and _example(match["source"]).dim() == 2:
                _copy_example(user, unflattened[index])
            user.replace_all_uses_with((q, scales)[index])
    _erase(graph, [*quant.users, quant] + ([flatten] if flatten is not None else []))
    return fused


def _fuse_residual_norm_quant(graph: fx.Graph, match: dict[str, object]) -> bool:
    """getitem(fused_add_rms_norm(x, residual, w, eps), 0) -> quant."""
    normed = match["source"]
    if not _is_function(normed, operator.getitem) or normed.args[1] != 0:
        return False
    norm = normed.args[0]
    if not _is_op(norm, torch.ops.v1_engine.fused_add_rms_norm):
        return False
    outputs = _outputs_by_index(norm)
    if outputs is None or outputs.get(0) != [normed]:
        return False
    x, residual, weight, eps = norm.args
    dtypes = {getattr(_example(node), "dtype", None) for node in (x, residual)}
    if len(dtypes) != 1 or None in dtypes:  # the kernel reads both in one dtype
        return False
    fused = _replace_quant(graph, match, norm, "add_rms_norm", (x, residual, weight, eps))
    with graph.inserting_after(fused):
        new_residual = graph.call_function(operator.getitem, (fused, 2))
    for old_residual in outputs.get(1, []):
        _copy_example(old_residual, new_residual)
        old_residual.replace_all_uses_with(new_residual)
    _erase(graph, [*outputs.get(1, []), normed, norm])
    return True


def _fuse_plain_norm_quant(graph: fx.Graph, match: dict[str, object]) -> bool:
    """The raw RMSNorm chain (no residual) -> quant."""
    norm = _match_rms_norm(match["source"])
    if norm is None:
        return False
    args = (norm["input"], norm["weight"], norm["eps"])
    _replace_quant(graph, match, match["source"], "rms_norm", args)
    _erase(graph, norm["dead"])
    return True


def fuse_rms_norm_fp8_quant(gm: fx.GraphModule) -> int:
    """RMSNorm (with or without the residual add) followed by the FP8 activation quant ->
    `v1_engine::[add_]rms_norm_per_token[_group]_fp8_quant`; runs fuse_add_rms_norm first.
    Returns the number of quant fusions."""
    fuse_add_rms_norm(gm)
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        match = _match_quant(node)
        if match is None:
            continue
        match["quant"] = node
        if _fuse_residual_norm_quant(graph, match) or _fuse_plain_norm_quant(graph, match):
            count += 1
    if count:
        gm.recompile()
    return count


def fuse_silu_and_mul_fp8_quant(gm: fx.GraphModule) -> int:
    """SiLU-and-mul followed by the FP8 activation quant ->
    `v1_engine::silu_and_mul_per_token[_group]_fp8_quant`; runs fuse_silu_and_mul first.
    Returns the number of quant fusions."""
    fuse_silu_and_mul(gm)
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        match = _match_quant(node)
        if match is None or not _is_op(match["source"], torch.ops.v1_engine.silu_and_mul):
            continue
        match["quant"] = node
        activation = match["source"]
        _replace_quant(graph, match, activation, "silu_and_mul", activation.args)
        _erase(graph, [activation])
        count += 1
    if count:
        gm.recompile()
    return count


# ---- FP8 linears without their activation quant at decode sizes -------------------------------
#
# An FP8 linear is `per_token_fp8_quant(x)` then `v1_engine::scaled_mm(q, w, scale, w_scale,
# out_dtype, bias)` (layers/quantization/fp8.py). Once the norm and SiLU quant fusions have run,
# the quant left alone (o_proj's) and the MLP's gate_up -> SiLU-and-mul + quant -> down chain
# become the ops of compile/passes/fp8_linear_ops.py, which skip the activation quant at the
# decode sizes kernels/triton_gemv_fp8.py's tables hold.


def _scaled_mm_call(node: object) -> tuple | None:
    """(a, b, scale_a, scale_b, out_dtype, bias) of a `v1_engine::scaled_mm` call."""
    if not _is_op(node, torch.ops.v1_engine.scaled_mm) or len(node.args) < 5:
        return None
    bias = node.args[5] if len(node.args) > 5 else node.kwargs.get("bias")
    if set(node.kwargs) - {"bias"}:
        return None
    return (*node.args[:5], bias)


def _same_shape_alias(node: fx.Node) -> bool:
    """A `reshape` / `view` call that keeps its input's shape (the fused quants' flattening of
    an already 2-D activation)."""
    if not (_is_method(node, "reshape") or _is_method(node, "view")) or node.kwargs:
        return False
    source = node.args[0]
    before = _example(source) if isinstance(source, fx.Node) else None
    after = _example(node)
    return before is not None and after is not None and before.shape == after.shape


def _quantized_input(
    mm: fx.Node, quant_op: torch._ops.OpOverloadPacket
) -> tuple[fx.Node, list[fx.Node]] | None:
    """The `quant_op` call whose (q, scales) are scaled_mm `mm`'s a and scale_a (directly or
    through same-shape reshapes) and are read by nothing else, with the nodes between (users
    first)."""
    between = []
    operands = []
    for node in (mm.args[0], mm.args[2]):
        if not isinstance(node, fx.Node) or not _only_used_by(node, mm):
            return None
        if _same_shape_alias(node):
            between.append(node)
            if not _only_used_by(node.args[0], node):
                return None
            node = node.args[0]
        operands.append(node)
    a, scale_a = operands
    if not (_is_function(a, operator.getitem) and _is_function(scale_a, operator.getitem)):
        return None
    quant = a.args[0]
    if scale_a.args[0] is not quant or (a.args[1], scale_a.args[1]) != (0, 1):
        return None
    if not _is_op(quant, quant_op) or _outputs_by_index(quant) != {0: [a], 1: [scale_a]}:
        return None
    return quant, [*between, a, scale_a]


def fuse_fp8_dynamic_linear(gm: fx.GraphModule) -> int:
    """per_token_fp8_quant(x) -> scaled_mm(q, w, scale, w_scale, out_dtype, bias) for a 2-D x
    => `v1_engine::fp8_dynamic_linear(x, w, w_scale, out_dtype, bias)`; runs the norm and SiLU
    quant fusions first, so only quants no kernel before them could take are matched. Returns
    matches."""
    fuse_rms_norm_fp8_quant(gm)
    fuse_silu_and_mul_fp8_quant(gm)
    ops = torch.ops.v1_engine
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        call = _scaled_mm_call(node)
        if call is None:
            continue
        found = _quantized_input(node, ops.per_token_fp8_quant)
        if found is None or len(found[0].args) != 1 or found[0].kwargs:
            continue
        quant, between = found
        x = quant.args[0]
        example = _example(x) if isinstance(x, fx.Node) else None
        if example is None or example.dim() != 2:
            continue
        _, weight, _, weight_scale, out_dtype, bias = call
        with graph.inserting_before(node):
            fused = graph.call_function(
                ops.fp8_dynamic_linear.default, (x, weight, weight_scale, out_dtype, bias)
            )
        _copy_example(node, fused)
        node.replace_all_uses_with(fused)
        _erase(graph, [node, *between, quant])
        count += 1
    if count:
        gm.recompile()
    return count


def _gemm_behind(node: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """The scaled_mm call behind `node` through the layers' same-shape `reshape` / `view` and
    `to(dtype)` nodes, each read by the next alone: (the call, those nodes, users first)."""
    chain = []
    while isinstance(node, fx.Node) and not _is_op(node, torch.ops.v1_engine.scaled_mm):
        source = node.args[0] if node.args else None
        if not isinstance(source, fx.Node) or node.kwargs or not _only_used_by(source, node):
            return None
        if _is_method(node, "to"):
            if len(node.args) != 2 or not isinstance(node.args[1], torch.dtype):
                return None
        elif not _same_shape_alias(node):
            return None
        chain.append(node)
        node = source
    return (node, chain) if isinstance(node, fx.Node) else None


def fuse_fp8_gated_mlp(gm: fx.GraphModule) -> int:
    """scaled_mm(x_q, w_gate_up, ...) -> silu_and_mul_per_token_fp8_quant -> scaled_mm(., w_down,
    ...) (no bias, one out_dtype, 2-D) => `v1_engine::fp8_gated_mlp`; runs the SiLU quant fusion
    first. Returns matches."""
    fuse_silu_and_mul_fp8_quant(gm)
    ops = torch.ops.v1_engine
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        down = _scaled_mm_call(node)
        if down is None or down[5] is not None:
            continue
        found = _quantized_input(node, ops.silu_and_mul_per_token_fp8_quant)
        if found is None or len(found[0].args) != 1 or found[0].kwargs:
            continue
        quant, between = found
        if not isinstance(quant.args[0], fx.Node) or not _only_used_by(quant.args[0], quant):
            continue
        behind = _gemm_behind(quant.args[0])
        if behind is None or not _only_used_by(behind[0], (behind[1] or [quant])[-1]):
            continue
        gate_up_node, aliases = behind
        gate_up = _scaled_mm_call(gate_up_node)
        activation = _example(quant.args[0])
        if gate_up is None or gate_up[5] is not None or gate_up[4] != down[4]:
            continue
        if activation is None or activation.dim() != 2:
            continue
        q, w_gate_up, scale, s_gate_up, out_dtype, _ = gate_up
        _, w_down, _, s_down, _, _ = down
        args = (q, scale, w_gate_up, s_gate_up, w_down, s_down, out_dtype, activation.dtype)
        with graph.inserting_before(node):
            fused = graph.call_function(ops.fp8_gated_mlp.default, args)
        _copy_example(node, fused)
        node.replace_all_uses_with(fused)
        _erase(graph, [node, *between, quant, *aliases, gate_up_node])
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


FUSION_PASSES: dict[str, Callable[[fx.GraphModule], int]] = {
    "add_rms_norm": fuse_add_rms_norm,
    "silu_and_mul": fuse_silu_and_mul,
    "rms_norm_fp8_quant": fuse_rms_norm_fp8_quant,
    "silu_and_mul_fp8_quant": fuse_silu_and_mul_fp8_quant,
    "fp8_gated_mlp": fuse_fp8_gated_mlp,
    "fp8_dynamic_linear": fuse_fp8_dynamic_linear,
    "skinny_silu_mul": fuse_skinny_silu_mul,
    "fused_mlp": fuse_mlp,
    "skinny_add_rms_norm": fuse_skinny_add_rms_norm,
    "rope_kv_cache": fuse_rope_kv_cache,
}
"""Fusion passes by the name `CompilationConfig.fusion_passes` uses."""
