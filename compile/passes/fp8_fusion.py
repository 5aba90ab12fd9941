"""The FP8 fusion passes over the Dynamo FX graph (the helpers and base passes of
compile/passes/fusion.py): the activation quant fused into the RMSNorm / SiLU-and-mul before
it, and the FP8 linears that skip the activation quant at decode sizes."""

from __future__ import annotations

import operator

import torch
from torch import fx

# Imported for their side effect: registering the fused ops the passes insert.
import compile.passes.fp8_linear_ops
import compile.passes.fp8_norm_ops
import compile.passes.fused_quant_ops  # noqa: F401
from compile.passes.fusion import (
    _copy_example,
    _erase,
    _example,
    _fold_norm_into,
    _is_function,
    _is_method,
    _is_op,
    _match_rms_norm,
    _only_used_by,
    _outputs_by_index,
    _read_between,
    fuse_add_rms_norm,
    fuse_silu_and_mul,
)

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


def _quant_group_size(quant: fx.Node) -> tuple[bool, int | None]:
    """(is an activation quant node, its group size: None = per token)."""
    if _is_op(quant, torch.ops.v1_engine.per_token_fp8_quant) and len(quant.args) == 1:
        return True, None
    if _is_op(quant, torch.ops.v1_engine.per_token_group_fp8_quant) and len(quant.args) == 2:
        group_size = quant.args[1]
        return isinstance(group_size, int), group_size
    return False, None


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
# decode sizes FP8_TUNED_LAUNCH (kernels/fp8_launch.py) holds.


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
    mm: fx.Node,
    quant_op: torch._ops.OpOverloadPacket,
    positions: tuple[int, int] = (0, 2),
    more_outputs: bool = False,
) -> tuple[fx.Node, list[fx.Node]] | None:
    """The `quant_op` call whose (q, scales) are `mm`'s arguments at `positions` (scaled_mm's a
    and scale_a by default; directly or through same-shape reshapes) and are read by nothing
    else, with the nodes between (users first). `more_outputs`: the call may have outputs past
    those two (the fused norm's residual sum)."""
    between = []
    operands = []
    for node in (mm.args[positions[0]], mm.args[positions[1]]):
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
    if not _is_op(quant, quant_op):
        return None
    outputs = _outputs_by_index(quant)
    if outputs is None or (outputs.get(0), outputs.get(1)) != ([a], [scale_a]):
        return None
    if not more_outputs and set(outputs) != {0, 1}:
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


# ---- FP8 linears with the add + RMSNorm before them folded in at decode sizes -----------------
#
# After the norm quant fusion each of a layer's two norms is `add_rms_norm_per_token_fp8_quant`
# feeding one scaled_mm (qkv_proj) or the FP8 MLP (fp8_gated_mlp's op where that pass ran first,
# else gate_up's scaled_mm). Both become the ops of compile/passes/fp8_norm_ops.py, which fold the
# norm into the GEMM at the decode sizes the "norm" / "norm_gated" tables hold.


def fuse_fp8_norm_linear(gm: fx.GraphModule) -> int:
    """add_rms_norm_per_token_fp8_quant(x, r, w, eps) whose (q, scale) feed only scaled_mm(q, W,
    scale, ...) => `v1_engine::fp8_add_norm_linear`; feeding only fp8_gated_mlp(q, scale, ...)
    => `v1_engine::fp8_add_norm_gated_mlp` (x 2-D). The residual sum becomes the op's second
    output. Runs the norm quant fusion first; put it after fp8_gated_mlp so the MLP form is seen.
    Returns matches."""
    fuse_rms_norm_fp8_quant(gm)
    ops = torch.ops.v1_engine
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if _scaled_mm_call(node) is not None:
            positions, op = (0, 2), ops.fp8_add_norm_linear.default
        elif _is_op(node, ops.fp8_gated_mlp) and len(node.args) == 8 and not node.kwargs:
            positions, op = (0, 1), ops.fp8_add_norm_gated_mlp.default
        else:
            continue
        found = _quantized_input(node, ops.add_rms_norm_per_token_fp8_quant, positions, True)
        if found is None or len(found[0].args) != 4 or found[0].kwargs:
            continue
        norm, between = found
        x, residual, norm_weight, eps = norm.args
        example = _example(x) if isinstance(x, fx.Node) else None
        old_sums = _outputs_by_index(norm).get(2, [])
        if example is None or example.dim() != 2 or _read_between(old_sums, norm, node):
            continue
        if op is ops.fp8_add_norm_linear.default:
            _, weight, _, weight_scale, out_dtype, bias = _scaled_mm_call(node)
            rest = (weight, weight_scale, out_dtype, bias)
        else:
            rest = tuple(node.args[2:])
        args = (x, residual, norm_weight, eps, *rest)
        _fold_norm_into(graph, node, op, args, old_sums, [*between, norm])
        count += 1
    if count:
        gm.recompile()
    return count
