"""The piecewise torch.compile backend.

Dynamo hands us the model's forward as one FX graph, traced once with the number of tokens
symbolic. We split it at the attention custom ops (SPLITTING_OPS): each piece between two
attention calls is compiled by Inductor once, for the symbolic shape, and the attention ops stay
eager between the pieces. Keeping attention out of the compiled pieces is what lets one compiled
graph serve every batch (its metadata lives in the forward context, not in the graph) and, on
CUDA, what lets piecewise graphs be captured around it.

The pieces between two decoder layers are the same graph with different weights (Dynamo lifts
parameters as graph inputs), so Inductor compiles each distinct piece once and its structural
twins reuse the compiled callable: three compilations for any depth of a plain decoder stack.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from tqdm import tqdm

from compile.cuda_graphs import GraphedPiece, PiecewiseState

logger = logging.getLogger(__name__)

SPLITTING_OPS: tuple[str, ...] = ("v1_engine::unified_attention", "v1_engine::mla_attention")
"""Custom ops the graph is split at; they run eagerly between the compiled pieces."""

GraphPass = Callable[[fx.GraphModule], Any]


@dataclass
class CompileStats:
    """What compiling cost; the runner logs it in the startup breakdown."""

    num_traces: int = 0
    """Graphs the backend compiled: Dynamo's trace, or the graph an earlier start saved (then
    `loaded`); 1 for a healthy run, more means a recompile."""
    loaded: bool = False
    """The forward came from the compile cache's saved artifact: no Dynamo trace this start."""
    num_pieces: int = 0
    """Compute pieces (the graph between attention ops), each run by a compiled callable."""
    num_compiled: int = 0
    """Distinct pieces Inductor actually compiled: a piece structurally identical to an earlier
    one (a middle decoder layer) reuses its compiled callable."""
    num_splitting_ops: int = 0
    inductor_s: float = 0.0
    pass_matches: dict[str, int] = field(default_factory=dict)
    """Replacements made by each fusion pass, by pass name."""


def op_name(node: fx.Node) -> str | None:
    """`namespace::name` of a custom-op call node (packet or overload), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_splitting_node(node: fx.Node, splitting_ops: Sequence[str]) -> bool:
    return op_name(node) in splitting_ops


def split_graph(
    gm: fx.GraphModule, splitting_ops: Sequence[str]
) -> tuple[fx.GraphModule, list[str], list[str]]:
    """Split `gm` so each splitting op sits alone in its own submodule.

    Returns (split module, names of the compute pieces, names of the splitting pieces), each
    list in execution order.
    """
    partition = 0
    partition_of: dict[fx.Node, int] = {}
    splitting_partitions: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            partition += 1
            partition_of[node] = partition
            splitting_partitions.add(partition)
            partition += 1
        else:
            partition_of[node] = partition
    split = split_module(gm, None, lambda n: partition_of[n], keep_original_order=True)
    _check_piece_outputs(split)
    pieces, splitting = [], []
    for name, _ in split.named_children():
        index = int(name.removeprefix("submod_"))
        (splitting if index in splitting_partitions else pieces).append(name)
    return split, pieces, splitting


def _check_piece_outputs(split: fx.GraphModule) -> None:
    """Refuse a split where a piece hands a symbolic bool to a later one: Inductor cannot
    compile a graph with such an output (on CUDA it fails deep inside lowering). It comes from
    a Python comparison with the token count inside the forward (a shape check), which must
    run in eager mode only."""
    for name, piece in split.named_children():
        for node in piece.graph.nodes:
            if node.op != "output":
                continue
            outputs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for out in outputs:
                value = out.meta.get("example_value") if isinstance(out, fx.Node) else None
                if isinstance(value, torch.SymBool):
                    raise RuntimeError(  # noqa: TRY004 (a graph we cannot compile, not a type)
                        f"compiled piece {name} passes the symbolic bool {value} ({out.name}) to "
                        "a later piece: a comparison with the traced token count inside the "
                        "forward; guard it with torch.compiler.is_compiling()"
                    )


# ---- structural identity of pieces ------------------------------------------------------------

_PLAIN_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
"""Values whose repr says all there is to them (floats repr exactly: 1e-05 != 1e-06)."""

_SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)

_OPERATOR_TYPES = (
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
    torch._ops.HigherOrderOperator,
)


class _Undescribable(Exception):
    """Something in a piece the key cannot describe safely: the piece is compiled alone."""


def piece_key(gm: fx.GraphModule, example_args: Sequence[Any]) -> str | None:
    """sha256 of what decides a piece's compiled code, or None when that cannot be described.

    Two pieces with the same key compute the same function of their arguments, so one compiled
    callable serves both: the graph with nodes numbered in order (placeholder names, which carry
    the layer index, are left out) and the arguments' metadata (shapes, strides, dtypes, aliasing;
    never values, since parameters are graph inputs). Captured constants or submodules (get_attr,
    call_module), closures and values without a faithful repr make the key None.
    """
    try:
        lines = _describe_graph(gm.graph) + _describe_args(example_args)
    except _Undescribable as reason:
        logger.debug("piece compiled alone: %s", reason)
        return None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _describe_graph(graph: fx.Graph) -> list[str]:
    numbers: dict[fx.Node, int] = {}
    lines = []
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            raise _Undescribable(f"{node.op} node {node.name} captures state")
        target = _target_name(node) if node.op in ("call_function", "call_method") else ""
        args = _describe_value(node.args, numbers)
        kwargs = _describe_value(node.kwargs, numbers)
        numbers[node] = len(numbers)
        lines.append(f"{numbers[node]} {node.op} {target} {args} {kwargs}")
    return lines


def _target_name(node: fx.Node) -> str:
    """The target of a call as a string naming it uniquely in the process."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, _OPERATOR_TYPES):
        return _operator_name(target)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    bound_to = getattr(target, "__self__", None)
    # A closure or a bound method carries state its name does not show.
    if module is None or qualname is None or "<" in qualname:
        raise _Undescribable(f"call target {target!r} has no global name")
    if bound_to is not None and not isinstance(bound_to, (type, type(torch))):
        raise _Undescribable(f"call target {target!r} is bound to an object")
    return f"{module}.{qualname}"


def _operator_name(op: Any) -> str:
    """Operators are process-wide singletons named by their namespace and overload."""
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"hop:{op.name()}"
    return f"op:{op}"


def _describe_value(value: Any, numbers: dict[fx.Node, int]) -> str:
    if isinstance(value, fx.Node):
        return f"%{numbers[value]}"
    if isinstance(value, _OPERATOR_TYPES):
        return _operator_name(value)
    if isinstance(value, _PLAIN_TYPES):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, _SYMBOLIC_TYPES):
        return f"{type(value).__name__}:{value}"
    if value is Ellipsis:
        return "..."
    if isinstance(value, slice):
        parts = (value.start, value.stop, value.step)
        return f"slice({','.join(_describe_value(p, numbers) for p in parts)})"
    if isinstance(value, (tuple, list)):
        items = ",".join(_describe_value(v, numbers) for v in value)
        return f"{type(value).__name__}({items})"
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = ",".join(f"{k}={_describe_value(v, numbers)}" for k, v in value.items())
        return f"dict({items})"
    raise _Undescribable(f"value {value!r} of type {type(value).__name__}")


def _describe_args(args: Sequence[Any]) -> list[str]:
    """Metadata of the example arguments; a tensor also says which earlier argument it shares
    memory with (compiled code may assume its inputs do not alias)."""
    storages: dict[StorageWeakRef, int] = {}
    lines = []
    for index, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            lines.append(f"arg {_describe_value(arg, {})}")
            continue
        if is_traceable_wrapper_subclass(arg) or arg.layout != torch.strided:
            raise _Undescribable(f"argument {index} is a {type(arg).__name__} ({arg.layout})")
        storage = StorageWeakRef(arg.untyped_storage())
        alias_of = storages.setdefault(storage, index)
        lines.append(
            f"tensor {type(arg).__name__} shape={[str(s) for s in arg.shape]} "
            f"stride={[str(s) for s in arg.stride()]} offset={arg.storage_offset()} "
            f"{arg.dtype} {arg.device} grad={arg.requires_grad} "
            f"inference={arg.is_inference()} alias_of={alias_of}"
        )
    return lines


def _sharing_is_safe() -> bool:
    """Inductor settings under which a compiled piece depends on more than its graph and its
    arguments' metadata: freezing folds parameter values into the code, and its own CUDA graphs
    record the addresses of one piece's weights."""
    from torch._inductor import config as inductor_config

    return not (inductor_config.freezing or inductor_config.triton.cudagraphs)


# ---- compiling the pieces ---------------------------------------------------------------------


class _PieceCompiler(fx.Interpreter):
    """Runs the split module on Dynamo's fake inputs, compiling each compute piece with
    Inductor on the fake arguments it actually receives, and swapping it in place.

    A piece whose structural key (piece_key) matches an earlier piece's reuses that piece's
    compiled callable: a 32-layer model compiles 3 pieces (first, middle, last), not 33. Each
    piece still gets its own wrapper (`wrap_piece`), which may hold per-piece state.
    """

    def __init__(
        self,
        module: fx.GraphModule,
        pieces: set[str],
        compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
        *,
        wrap_piece: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
        share: bool = True,
        progress: Any = None,
    ) -> None:
        super().__init__(module)
        self.pieces = pieces
        self.compile_piece = compile_piece
        self.wrap_piece = wrap_piece
        self.share = share
        """Reuse one compiled callable for structurally identical pieces."""
        self.progress = progress
        """A tqdm bar advanced once per piece (None: no progress display)."""
        self.compiled_by_key: dict[str, Callable[..., Any]] = {}
        self.num_compiled = 0

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        output = super().call_module(target, args, kwargs)
        if target in self.pieces:
            compiled = self._compiled(getattr(self.module, target), list(args))
            wrapped = compiled if self.wrap_piece is None else self.wrap_piece(compiled)
            setattr(self.module, target, _CompiledPiece(wrapped))
            if self.progress is not None:
                self.progress.update(1)
                self.progress.set_postfix(compiled=self.num_compiled, refresh=False)
        return output

    def _compiled(self, piece: fx.GraphModule, args: list[Any]) -> Callable[..., Any]:
        key = piece_key(piece, args) if self.share else None
        if key is not None and key in self.compiled_by_key:
            return self.compiled_by_key[key]
        compiled = self.compile_piece(piece, args)
        self.num_compiled += 1
        if key is not None:
            self.compiled_by_key[key] = compiled
        return compiled


class _CompiledPiece(torch.nn.Module):
    """An Inductor-compiled piece standing where its FX submodule was."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any) -> Any:
        return self.compiled(*args)


class PiecewiseBackend:
    """A torch.compile backend: passes, split at SPLITTING_OPS, Inductor on each piece.

    One instance serves one model. A second trace means Dynamo recompiled (a guard failed); the
    backend refuses it when `allow_recompile` is False, so a recompile while serving fails loudly
    instead of stalling a step for seconds.
    """

    def __init__(
        self,
        splitting_ops: Sequence[str] = SPLITTING_OPS,
        passes: Sequence[tuple[str, GraphPass]] = (),
        use_inductor: bool = True,
        cudagraphs: bool = False,
    ) -> None:
        """`cudagraphs` wraps each compiled piece so it can capture and replay piecewise CUDA
        graphs (driven through `graph_state` by compile.cuda_graphs.PiecewiseCudaGraphs)."""
        self.splitting_ops = tuple(splitting_ops)
        self.passes = tuple(passes)
        self.use_inductor = use_inductor
        self.allow_recompile = True
        self.stats = CompileStats()
        self.split_module: fx.GraphModule | None = None
        self.graph_state = PiecewiseState() if cudagraphs else None
        self.serializable = False
        """Return a PiecewiseArtifact (compile/aot.py) rather than the bare split module."""

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Dynamo's entry: passes, split, compile. With `serializable` set (the trace of an
        ahead-of-time compile, compile/aot.py) it only runs the passes and returns the graph
        pickled, uncompiled: the caller saves it and compiles it through `compile_loaded`, as
        every later start will, so they find Inductor's cache entries for exactly that graph."""
        self._count_trace()
        for name, graph_pass in self.passes:
            self.stats.pass_matches[name] = int(graph_pass(gm) or 0)
        if self.serializable:
            from compile.aot import PiecewiseArtifact, pickle_graph

            return PiecewiseArtifact(None, pickle_graph(gm), self.stats.pass_matches)
        return self._split_and_compile(gm, example_inputs)

    def compile_loaded(
        self, gm: fx.GraphModule, example_inputs: list[Any], pass_matches: dict[str, int]
    ) -> Callable[..., Any]:
        """A graph saved by an earlier start (compile/aot.py): its passes already ran, so it
        is only split and compiled (Inductor's cache answers for the pieces)."""
        self._count_trace()
        self.stats.pass_matches = dict(pass_matches)
        return self._split_and_compile(gm, example_inputs)

    def _count_trace(self) -> None:
        if self.stats.num_traces and not self.allow_recompile:
            raise RuntimeError(
                "torch.compile recompiled the model forward while serving (a Dynamo guard "
                "failed); the compiled graph must serve every batch size"
            )
        self.stats.num_traces += 1

    def _split_and_compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> fx.GraphModule:
        split, pieces, splitting = split_graph(gm, self.splitting_ops)
        self.stats.num_pieces = len(pieces)
        self.stats.num_splitting_ops = len(splitting)
        if self.use_inductor:
            self._compile_pieces(split, pieces, example_inputs)
        self.split_module = split
        logger.debug(
            "piecewise split: %d pieces (%d compiled), %d splitting ops",
            len(pieces),
            self.stats.num_compiled,
            len(splitting),
        )
        return split

    def reset(self) -> None:
        """Forget a failed compile (a fallback compiles again from scratch)."""
        self.stats = CompileStats()
        self.split_module = None
        if self.graph_state is not None:
            self.graph_state = PiecewiseState()

    def _compile_pieces(
        self, split: fx.GraphModule, pieces: list[str], example_inputs: list[Any]
    ) -> None:
        from torch._guards import detect_fake_mode
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        fake_mode = detect_fake_mode(example_inputs)
        assert fake_mode is not None, "Dynamo passes fake example inputs"
        fake_inputs = [
            fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs
        ]
        state = self.graph_state
        wrap_piece = None
        if state is not None:

            def wrap_piece(compiled: Callable[..., Any]) -> GraphedPiece:
                return GraphedPiece(compiled, state)

        with tqdm(total=len(pieces), desc="Compiling with Inductor", unit="piece") as progress:
            interpreter = _PieceCompiler(
                split,
                set(pieces),
                compile_fx,
                wrap_piece=wrap_piece,
                share=_sharing_is_safe(),
                progress=progress,
            )
            with fake_mode:
                interpreter.run(*fake_inputs)
        self.stats.num_compiled = interpreter.num_compiled
        self.stats.inductor_s += time.perf_counter() - start
