"""Full CUDA graphs of decode steps: the whole forward replayed with one launch.

A uniform decode batch (every request computes exactly one token) has a shape fixed by its number
of requests, so its entire forward pass (the compiled pieces and the attention kernels between
them) can be captured once per batch size and replayed. Replay costs one launch instead of a few
hundred, which is what makes small-batch decode memory-bound rather than launch-bound.

Everything a captured graph reads lives in persistent buffers owned here (token ids, positions,
slot mapping, sequence lengths, block table); a step copies its inputs into them and replays the
graph of the smallest captured size that holds its batch. Padding rows decode a dummy token: their
K/V write is skipped (slot -1) and they attend over one cached position, so they stay finite and
are never read back.

Speculative decoding's verify steps (each request its last token and up to k drafts) get the same
treatment from `VarlenCudaGraphs`: one graph per request count, with room for 1 + k tokens a
request, serving any mix of query lengths up to that.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.forward_context import set_forward_context
from v1_engine.kernels.triton_inputs import write_decode_inputs, write_varlen_inputs

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def fast_capture() -> Iterator[None]:
    """Skip the garbage collection and cache flush torch.cuda.graph does on entering each
    capture: with a model's worth of live Python objects that costs tens of milliseconds, and a
    capture run enters it thousands of times (every piece at every size)."""
    collect, empty_cache = gc.collect, torch.cuda.empty_cache
    gc.collect = lambda generation=2: 0
    torch.cuda.empty_cache = lambda: None
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = collect, empty_cache


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor
    """The graph's output buffer [size, hidden]; valid after each replay until the next one."""


class _FullGraphs:
    """Whole-forward CUDA graphs, one per captured number of requests, over persistent input
    buffers (a subclass fills them per step and describes a captured size's metadata).

    Graphs are captured largest first into one shared memory pool: a graph's intermediate
    buffers are freed once it is captured, so the next (smaller) graph reuses the same memory and
    the pool costs about what the largest batch's activations do.
    """

    kind = "full"

    def __init__(
        self,
        forward: Forward,
        capture_sizes: Iterable[int],
        max_blocks_per_req: int,
        max_seq_len: int,
        device: torch.device,
        pool: tuple[int, int] | None = None,
        query_len: int = 1,
    ) -> None:
        self.forward = forward
        self.sizes = sorted(set(capture_sizes))
        if not self.sizes:
            raise ValueError("cudagraph capture sizes must not be empty")
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        self.query_len = query_len
        """Query tokens per request a graph has room for (1 for decode graphs)."""
        self.max_seq_len = max_seq_len
        """The longest context a request may reach: the attention launch is sized for it."""
        self.device = device
        n = self.sizes[-1]
        rows = n + self._extra_rows
        tokens = n * query_len
        # Inference tensors, like a step's inputs: Dynamo guards on the dispatch keys.
        with torch.inference_mode():
            self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
            self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
            # Before a step's inputs arrive (warm-up and capture), every request of the largest
            # graph holds query_len tokens of its own query_len positions (`_capture_inputs`
            # sets each smaller size's).
            self.seq_lens = torch.full((rows,), query_len, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
            self.query_start_loc.mul_(query_len).clamp_(max=tokens)
            self.block_table = torch.zeros(
                (rows, max_blocks_per_req), dtype=torch.int32, device=device
            )
        self._graphs: dict[int, _Captured] = {}
        self._pool = pool
        self.capture_s = 0.0
        self.pool_bytes = 0
        """Device memory the captures took (the shared pool plus graph objects)."""
        self.num_replays = 0

    _extra_rows = 0
    """Metadata rows past the largest size (a varlen graph's padding request)."""

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a batch of `num_reqs` requests runs at, or None."""
        index = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the persistent buffers, as a captured graph of `size` sees it."""
        raise NotImplementedError

    def _capture_inputs(self, size: int) -> None:
        """Valid inputs for the warm-up and capture of the graph of `size` in the buffers (the
        kernels run for real then): none to write where the initial buffers serve every size."""

    @torch.inference_mode()
    def capture(self, attn_backend: object, attention_layers: list) -> None:
        """Capture one graph per size, largest first, sharing one memory pool."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        sizes = sorted(self.sizes, reverse=True)
        gc.collect()
        for size in tqdm(sizes, desc=f"Capturing {self.kind} CUDA graphs", unit="graph"):
            self._capture_inputs(size)
            metadata = self._metadata(size)
            tokens = metadata.num_actual_tokens
            input_ids, positions = self.input_ids[:tokens], self.positions[:tokens]
            with set_forward_context(metadata, attn_backend, attention_layers):
                # Warm-up outside capture: kernels compile and allocators settle here.
                self.forward(input_ids, positions)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with fast_capture(), torch.cuda.graph(graph, pool=self._pool):
                    output = self.forward(input_ids, positions)
            self._graphs[size] = _Captured(graph, output)
        torch.cuda.synchronize(self.device)
        self.pool_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        self.capture_s = time.perf_counter() - start
        logger.info(
            "captured %d %s CUDA graphs (batch sizes %d..%d, %d query tokens a request) in "
            "%.1f s, %.2f GiB",
            len(sizes),
            self.kind,
            self.sizes[0],
            self.max_size,
            self.query_len,
            self.capture_s,
            self.pool_bytes / 2**30,
        )


class DecodeCudaGraphs(_FullGraphs):
    """Whole-forward CUDA graphs of uniform decode batches (one query token a request), one per
    captured batch size."""

    kind = "decode"

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A uniform decode step whose batch fits a captured graph."""
        return (
            metadata.max_query_len == 1
            and metadata.num_actual_tokens == metadata.num_reqs
            and metadata.num_reqs <= self.max_size
            and bool(self._graphs)
        )

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(size, dtype=torch.int32),
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        feed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The forward of a decode step by graph replay: hidden states [num_reqs, hidden].

        `feed` = ([num_reqs] source rows, -1 for none; the previous step's sampled tokens): the
        tokens fed into input_ids on the device (kernels/triton_inputs.py writes them with the
        step's other inputs and the padding rows in one launch). The returned tensor is the
        graph's output buffer: read it before the next replay."""
        n = metadata.num_reqs
        size = self.padded_size(n)
        assert size is not None and size in self._graphs, f"no graph holds {n} requests"
        write_decode_inputs(
            (
                input_ids[:n],
                positions[:n],
                metadata.slot_mapping[:n],
                metadata.seq_lens,
                metadata.block_table,
            ),
            (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_table),
            size,
            feed,
        )
        self._graphs[size].graph.replay()
        self.num_replays += 1
        return self._graphs[size].output[:n]


class VarlenCudaGraphs(_FullGraphs):
    """Whole-forward CUDA graphs of steps whose requests each compute at most `query_len` tokens:
    speculative decoding's verify steps (a decoding request's last token and its drafts), whose
    query lengths differ per request and from step to step.

    The graph of `size` requests is captured for size x query_len tokens and size + 1 requests
    with the longest query `query_len`; the paged-attention launch covers any packing of those
    tokens over those requests (its grid bounds the q-blocks by tokens and requests, not by the
    query lengths). A step of n <= size requests and T tokens copies its packed inputs in; the
    requests up to size get no token, and the last one owns the T..size x query_len padding
    tokens (slot -1: no cache write; it attends over its own positions, so every computed row
    is defined). Needs an attention backend whose captured launch depends only on those counts
    (`supports_varlen_cudagraph`), and a forward whose ops mix no rows other than through
    attention.
    """

    kind = "verify"
    _extra_rows = 1

    def __init__(
        self,
        forward: Forward,
        capture_sizes: Iterable[int],
        max_blocks_per_req: int,
        max_seq_len: int,
        device: torch.device,
        pool: tuple[int, int] | None = None,
        query_len: int = 2,
        block_size: int = 16,
    ) -> None:
        capture_sizes = list(capture_sizes)
        # The padding request may own every token of the largest graph: its positions.
        most = max(capture_sizes, default=0) * query_len
        width = max(max_blocks_per_req, -(-most // block_size))
        super().__init__(forward, capture_sizes, width, max(max_seq_len, most), device, pool,
                         query_len)  # fmt: skip

    def can_run(self, metadata: AttentionMetadata) -> bool:
        """A step whose requests each compute at most query_len tokens, in a captured size."""
        return (
            metadata.max_query_len <= self.query_len
            and metadata.num_reqs <= self.max_size
            and bool(self._graphs)
        )

    def _capture_inputs(self, size: int) -> None:
        """Every request of the graph of `size` with query_len tokens of its own, the padding
        request with none: the buffers' query starts end at size x query_len, not at the
        largest graph's token count (a launch would read and write past its tensors)."""
        q, rows = self.query_len, size + 1
        starts = torch.arange(rows + 1, dtype=torch.int32).mul_(q).clamp_(max=size * q)
        with torch.inference_mode():
            self.query_start_loc[: rows + 1].copy_(starts)
            self.seq_lens[:rows].fill_(q)
            self.slot_mapping.fill_(-1)

    def _metadata(self, size: int) -> AttentionMetadata:
        q, rows = self.query_len, size + 1
        tokens = size * q
        starts = torch.arange(rows + 1, dtype=torch.int32).mul_(q).clamp_(max=tokens)
        return AttentionMetadata(
            num_actual_tokens=tokens,
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_table=self.block_table[:rows],
            slot_mapping=self.slot_mapping[:tokens],
            max_query_len=q,
            max_seq_len=self.max_seq_len,
            query_start_loc_cpu=starts,
            seq_lens_cpu=torch.full((rows,), q, dtype=torch.int32),
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The forward of the step by graph replay: hidden states [num_tokens, hidden] (the
        graph's output buffer: read it before the next replay). Any feed of the previous step's
        tokens must already be in input_ids."""
        size = self.write_inputs(input_ids, positions, metadata)
        assert size in self._graphs, f"no graph of {size} requests"
        self._graphs[size].graph.replay()
        self.num_replays += 1
        return self._graphs[size].output[: metadata.num_actual_tokens]

    def write_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> int:
        """The step's inputs into the buffers of the graph that runs it; returns its size (the
        graph then reads the buffers as `_metadata(size)` describes them)."""
        n, num_tokens = metadata.num_reqs, metadata.num_actual_tokens
        size = self.padded_size(n)
        assert size is not None, f"no graph holds {n} requests"
        write_varlen_inputs(
            (
                input_ids[:num_tokens],
                positions[:num_tokens],
                metadata.slot_mapping[:num_tokens],
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.block_table,
            ),
            (
                self.input_ids,
                self.positions,
                self.slot_mapping,
                self.query_start_loc,
                self.seq_lens,
                self.block_table,
            ),
            size,
            size * self.query_len,
        )
        return size


# ---- piecewise graphs -------------------------------------------------------------------------


def non_owning(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor`'s memory that does not keep it allocated.

    A captured piece's outputs live in the shared graph pool. Holding them strongly would pin
    every size's intermediates at once; a non-owning view lets the next (smaller) capture reuse
    the memory, which is safe because only one size's graphs replay at a time and each output is
    consumed before the next replay."""
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), tensor.device, tensor.untyped_storage().nbytes()
    )
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return view.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def _map_tensors(value: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


@dataclass
class PiecewiseState:
    """What the compiled pieces consult on each call: set by PiecewiseCudaGraphs per step."""

    size: int | None = None
    """Padded token count of this forward, when it runs through graphs; None runs eagerly."""
    capturing: bool = False
    pool: tuple[int, int] | None = None


@dataclass
class _PieceGraph:
    graph: torch.cuda.CUDAGraph
    input_ptrs: list[int | None]
    inputs: list[torch.Tensor | None]
    """Non-owning views of the captured inputs, to copy into if an address ever differs."""
    output: object


class GraphedPiece(torch.nn.Module):
    """A compiled piece that captures one CUDA graph per padded token count and replays it.

    The pieces of one forward run in a fixed order and every input of a piece is either a
    parameter, a static input buffer of the runner, or an output of an earlier piece (or the
    attention output buffer that piece allocated), so replays see the addresses captured. That is
    checked on every replay; a mismatch copies the input into place rather than read stale memory.
    """

    def __init__(self, compiled: Callable[..., object], state: PiecewiseState) -> None:
        super().__init__()
        self.compiled = compiled
        self.state = state
        self.graphs: dict[int, _PieceGraph] = {}

    def forward(self, *args: object) -> object:
        size = self.state.size
        if size is None:
            return self.compiled(*args)
        if self.state.capturing:
            return self._capture(size, args)
        entry = self.graphs.get(size)
        if entry is None:
            return self.compiled(*args)
        for arg, ptr, static in zip(args, entry.input_ptrs, entry.inputs):
            if ptr is not None and arg.data_ptr() != ptr:  # type: ignore[union-attr]
                static.copy_(arg)  # type: ignore[union-attr]
        entry.graph.replay()
        return entry.output

    def _capture(self, size: int, args: tuple[object, ...]) -> object:
        graph = torch.cuda.CUDAGraph()
        with fast_capture(), torch.cuda.graph(graph, pool=self.state.pool):
            output = self.compiled(*args)
        tensors = [a if isinstance(a, torch.Tensor) else None for a in args]
        self.graphs[size] = _PieceGraph(
            graph=graph,
            input_ptrs=[t.data_ptr() if t is not None else None for t in tensors],
            inputs=[non_owning(t) if t is not None else None for t in tensors],
            output=_map_tensors(output, non_owning),
        )
        return output


class PiecewiseCudaGraphs:
    """Piecewise CUDA graphs of the compiled forward: each compiled piece (everything between two
    attention ops) replays a graph captured for the step's padded token count, and attention runs
    eagerly between them, so any batch (prefill chunks, decodes, a mix) up to the largest size
    benefits. Inputs go through static buffers so the first piece always reads the same memory.
    """

    def __init__(
        self,
        forward: Forward,
        state: PiecewiseState,
        capture_sizes: Iterable[int],
        device: torch.device,
        pool: tuple[int, int] | None = None,
    ) -> None:
        self.forward = forward
        self.state = state
        self.sizes = sorted(set(capture_sizes))
        if not self.sizes:
            raise ValueError("cudagraph capture sizes must not be empty")
        self.device = device
        self.pool = pool
        n = self.sizes[-1]
        with torch.inference_mode():  # like a step's inputs: Dynamo guards on dispatch keys
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
            self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.capture_s = 0.0
        self.pool_bytes = 0
        self.num_replays = 0

    def padded_size(self, num_tokens: int) -> int | None:
        index = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[index] if index < len(self.sizes) else None

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.num_actual_tokens <= self.sizes[-1] and self.capture_s > 0

    @torch.inference_mode()
    def capture(self, attn_backend: object, attention_layers: list) -> None:
        """Capture every piece for every size, largest first; attention runs on no metadata
        (it zero-fills its output: values do not matter to a capture, shapes do)."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.state.pool = self.pool
        sizes = sorted(self.sizes, reverse=True)
        gc.collect()
        try:
            for size in tqdm(sizes, desc="Capturing piecewise CUDA graphs", unit="size"):
                for capturing in (False, True):  # warm-up run, then the capture
                    self.state.size, self.state.capturing = size, capturing
                    with set_forward_context(None, attn_backend, attention_layers):
                        self.forward(self.input_ids[:size], self.positions[:size])
                    torch.cuda.synchronize(self.device)
        finally:
            self.state.size, self.state.capturing = None, False
        self.pool_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        self.capture_s = time.perf_counter() - start
        logger.info(
            "captured piecewise CUDA graphs for %d token counts (%d..%d) in %.1f s, %.2f GiB",
            len(sizes),
            self.sizes[0],
            self.sizes[-1],
            self.capture_s,
            self.pool_bytes / 2**30,
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        attn_backend: object,
        attention_layers: list,
    ) -> torch.Tensor:
        """The forward of any step up to the largest size, padded: hidden [num_tokens, hidden]."""
        n = metadata.num_actual_tokens
        size = self.padded_size(n)
        assert size is not None, f"no piecewise graph holds {n} tokens"
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.state.size = size
        try:
            with set_forward_context(metadata, attn_backend, attention_layers):
                hidden = self.forward(self.input_ids[:size], self.positions[:size])
        finally:
            self.state.size = None
        self.num_replays += 1
        return hidden[:n]
