"""The forward compiled ahead of time: a warm start loads Dynamo's work instead of tracing.

A cold start traces the forward with Dynamo (torch.compile's `aot_compile`); the backend runs
the fusion passes and returns a `PiecewiseArtifact` holding the FX graph pickled with torch's
GraphPickler, and `trace_and_save` writes Dynamo's transformed bytecode, its guards and that
graph to `forward.aot` in the compile cache directory (an atomic rename, so a concurrent start
reads a whole file or none). Every start, the cold one included, then `load`s it: the backend
splits the unpickled graph and compiles each piece with Inductor, whose FX-graph cache (same
directory) answers on a warm start because the cold start compiled exactly that graph. A warm
start thus runs no Dynamo trace at all. The directory's key already covers the model config,
dtype, compilation config, torch / triton versions and this project's source, so a stale
artifact is never read.

torch's ahead-of-time compile is young (torch 2.10+); `supported()` says whether this torch has
it (and V1ENGINE_AOT_COMPILE=0 has not turned it off), and the caller falls back to plain
torch.compile when it does not or when saving / loading fails (CompiledForward logs why).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

if TYPE_CHECKING:
    from compile.backend import PiecewiseBackend

logger = logging.getLogger(__name__)

ENV_VAR = "V1ENGINE_AOT_COMPILE"
"""0 turns the ahead-of-time path off: every start traces with torch.compile."""

ARTIFACT = "forward.aot"
"""File name of the saved forward inside the compile cache directory."""

try:  # torch >= 2.12 keeps the protocol in its own module
    from torch._dynamo.aot_compile_types import SerializableCallable
except ImportError:  # pragma: no cover (older torch)
    try:
        from torch._dynamo.aot_compile import SerializableCallable
    except ImportError:
        SerializableCallable = object  # type: ignore[misc,assignment]

_LOADING: list[PiecewiseBackend] = []
"""The backend a `load` in progress compiles the unpickled graph with (deserialization is a
classmethod that torch calls, so the backend reaches it through here)."""


def supported() -> bool:
    """Whether this torch can compile a function ahead of time and load it back, and the path
    is not turned off ($V1ENGINE_AOT_COMPILE=0)."""
    if os.environ.get(ENV_VAR, "1").strip() == "0" or SerializableCallable is object:
        return False
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
        from torch.fx._graph_pickler import GraphPickler, Options  # noqa: F401
    except ImportError:
        return False
    # The parts of these private APIs this module relies on (they changed between releases).
    options = {f.name for f in dataclasses.fields(Options)}
    if not {"ops_filter", "node_metadata_key_filter"} <= options:
        return False
    if "f_globals" not in inspect.signature(AOTCompiledFunction.deserialize).parameters:
        return False
    if not hasattr(AOTCompiledFunction, "save_compiled_function"):
        return False
    with _aot_config():
        return hasattr(torch.compile(forward, fullgraph=True, backend="eager"), "aot_compile")


def _aot_config() -> Any:
    """Dynamo's config for an ahead-of-time compile: no automatic dynamic shapes (the token
    dimension is marked), and `enable_aot_compile` where this torch has the switch (2.11 adds
    `aot_compile` to a compiled function only with it on)."""
    patches: dict[str, Any] = {"automatic_dynamic_shapes": False}
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        patches["enable_aot_compile"] = True
    return torch._dynamo.config.patch(patches)


def forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What is traced: the model's forward, with the model an argument (its parameters are read
    from it at every call, never saved)."""
    return model(input_ids, positions)


def pickle_graph(gm: fx.GraphModule) -> bytes:
    """The graph with only its placeholders' metadata (their fake example inputs, symbolic token
    count included): the other nodes' metadata holds objects that do not pickle, and the
    backend re-derives what it needs by running the pieces on the example inputs."""
    from torch.fx._graph_pickler import GraphPickler, Options

    saved = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            saved[node], node.meta = node.meta, {}
    try:
        keep = ("example_value", "val")
        return GraphPickler.dumps(
            gm, Options(ops_filter=None, node_metadata_key_filter=keep.__contains__)
        )
    finally:
        for node, meta in saved.items():
            node.meta = meta


class PiecewiseArtifact(SerializableCallable):  # type: ignore[misc,valid-type]
    """The backend's compiled forward with what rebuilds it in another process."""

    def __init__(self, fn: Any, graph: bytes, pass_matches: dict[str, int]) -> None:
        self.fn = fn
        self.graph = graph
        self.pass_matches = dict(pass_matches)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: PiecewiseArtifact) -> bytes:
        return pickle.dumps({"graph": fn.graph, "pass_matches": fn.pass_matches})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> PiecewiseArtifact:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        if not _LOADING:
            raise RuntimeError("a PiecewiseArtifact is loaded only through compile.aot.load")
        state = pickle.loads(data)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        gm = GraphPickler.loads(state["graph"], fake_mode)
        example_inputs = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        backend = _LOADING[-1]
        fn = backend.compile_loaded(gm, example_inputs, state["pass_matches"])
        return cls(fn, state["graph"], state["pass_matches"])


def trace_and_save(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    backend: PiecewiseBackend,
    path: Path,
) -> None:
    """Trace `forward` with Dynamo for these example inputs (token dimension unbacked) into
    `backend`, made `serializable` for the trace (it returns the pickled graph, uncompiled), and
    save Dynamo's bytecode, guards and that graph at `path`."""
    # Copies carry the marks: the saved guards check that a runtime tensor has none.
    input_ids, positions = input_ids.clone(), positions.clone()
    torch._dynamo.decorators.mark_unbacked(input_ids, 0)
    torch._dynamo.decorators.mark_unbacked(positions, 0)
    backend.serializable = True
    try:
        with _aot_config():
            compiled = torch.compile(forward, fullgraph=True, backend=backend)
            traced = compiled.aot_compile(((model, input_ids, positions), {}))
    finally:
        backend.serializable = False
    traced.save_compiled_function(str(path))


def load(path: Path, backend: PiecewiseBackend) -> Any:
    """The AOTCompiledFunction saved at `path`, its pieces compiled by `backend`."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    data = path.read_bytes()
    _LOADING.append(backend)
    try:
        return AOTCompiledFunction.deserialize(data, f_globals=forward.__globals__)
    finally:
        _LOADING.pop()
