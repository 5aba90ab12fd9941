"""The piecewise torch.compile backend.

Dynamo hands us the model's forward as one FX graph, traced once with the number of tokens
symbolic. We split it at the attention custom ops (SPLITTING_OPS): each piece between two
attention calls is compiled by Inductor once, for the symbolic shape, and the attention ops stay
eager between the pieces. Keeping attention out of the compiled pieces is what lets one compiled
graph serve every batch (its metadata lives in the forward context, not in the graph) and, on
CUDA, what lets piecewise graphs be captured around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module
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
    """Graphs Dynamo handed to the backend: 1 for a healthy run, more means a recompile."""
    num_pieces: int = 0
    """Pieces compiled by Inductor (the graph between attention ops)."""
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


class _PieceCompiler(fx.Interpreter):
    """Runs the split module on Dynamo's fake inputs, compiling each compute piece with
    Inductor on the fake arguments it actually receives, and swapping it in place."""

    def __init__(
        self,
        module: fx.GraphModule,
        pieces: set[str],
        compile_piece: Callable[..., Any],
        progress: Any = None,
    ) -> None:
        super().__init__(module)
        self.pieces = pieces
        self.compile_piece = compile_piece
        self.progress = progress
        """A tqdm bar advanced once per compiled piece (None: no progress display)."""

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        output = super().call_module(target, args, kwargs)
        if target in self.pieces:
            submodule = getattr(self.module, target)
            compiled = self.compile_piece(submodule, list(args))
            setattr(self.module, target, _CompiledPiece(compiled))
            if self.progress is not None:
                self.progress.update(1)
        return output


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

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.stats.num_traces and not self.allow_recompile:
            raise RuntimeError(
                "torch.compile recompiled the model forward while serving (a Dynamo guard "
                "failed); the compiled graph must serve every batch size"
            )
        self.stats.num_traces += 1
        for name, graph_pass in self.passes:
            self.stats.pass_matches[name] = int(graph_pass(gm) or 0)
        split, pieces, splitting = split_graph(gm, self.splitting_ops)
        self.stats.num_pieces = len(pieces)
        self.stats.num_splitting_ops = len(splitting)
        if self.use_inductor:
            self._compile_pieces(split, pieces, example_inputs)
        self.split_module = split
        logger.debug("piecewise split: %d pieces, %d splitting ops", len(pieces), len(splitting))
        return split

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
        compile_piece: Callable[..., Any] = compile_fx
        state = self.graph_state
        if state is not None:

            def compile_piece(gm: fx.GraphModule, inputs: list[Any]) -> Any:
                return GraphedPiece(compile_fx(gm, inputs), state)

        with tqdm(total=len(pieces), desc="Compiling with Inductor", unit="piece") as progress:
            interpreter = _PieceCompiler(split, set(pieces), compile_piece, progress)
            with fake_mode:
                interpreter.run(*fake_inputs)
        self.stats.inductor_s += time.perf_counter() - start
