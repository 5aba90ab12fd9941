"""The model forward behind torch.compile: traced once, never recompiled while serving."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from compile.backend import SPLITTING_OPS, CompileStats, GraphPass, PiecewiseBackend

logger = logging.getLogger(__name__)


class CompiledForward:
    """Calls `model(input_ids, positions)` through the piecewise backend.

    The first call traces with the token dimension marked unbacked (symbolic with no 0/1
    specialisation), so one graph serves every step from a single decode token to a full prefill
    budget. Every later call runs under the "fail_on_recompile" stance: a guard failure raises
    instead of silently tracing and compiling again in the middle of serving.
    """

    def __init__(
        self,
        model: nn.Module,
        splitting_ops: Sequence[str] = SPLITTING_OPS,
        passes: Sequence[tuple[str, GraphPass]] = (),
        use_inductor: bool = True,
        cudagraphs: bool = False,
        cache_dir: Path | None = None,
    ) -> None:
        self.model = model
        self.backend = PiecewiseBackend(splitting_ops, passes, use_inductor, cudagraphs)
        self._compiled = torch.compile(model, backend=self.backend, fullgraph=True)
        self._aot = None
        """The ahead-of-time compiled forward (compile/aot.py), when that path is taken."""
        self.cache_dir = cache_dir
        self.trace_s = 0.0
        """Wall time of the first call: Dynamo tracing (or loading the saved trace) plus the
        backend's Inductor work."""

    @property
    def stats(self) -> CompileStats:
        return self.backend.stats

    @property
    def dynamo_s(self) -> float:
        return max(self.trace_s - self.stats.inductor_s, 0.0)

    @property
    def is_traced(self) -> bool:
        return self.stats.num_traces > 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.is_traced:
            return self._trace(input_ids, positions)
        if self._aot is not None:
            return self._call_aot(input_ids, positions)
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._compiled(input_ids, positions)

    def _call_aot(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        try:
            return self._aot(self.model, input_ids, positions)
        except RuntimeError as error:
            if "GuardManager check failed" not in str(error):
                raise
            raise RuntimeError(
                "the compiled model forward would need a recompile while serving (a guard "
                f"failed): {error}"
            ) from None

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.cache_dir is not None:
            output = self._trace_ahead_of_time(input_ids, positions)
            if output is not None:
                return output
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        start = time.perf_counter()
        # Dynamo shares a module's forward code across models: without this, a second model in
        # the process whose float attribute (an eps, a scaling factor) differs from the first's
        # makes "automatic dynamic" turn it into a symbol and restart the trace. The token
        # dimension is marked unbacked above, so nothing else needs to be dynamic.
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            output = self._compiled(input_ids, positions)
        self.trace_s = time.perf_counter() - start
        self._log_compiled()
        return output

    def _trace_ahead_of_time(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """Load the saved forward, or trace, compile and save it; None (the backend reset)
        when this torch cannot or something fails, and the caller traces as usual."""
        from compile import aot

        if not aot.supported():
            logger.info(
                "tracing the forward at every start (no ahead-of-time compile: this torch "
                "lacks it or %s=0)",
                aot.ENV_VAR,
            )
            return None
        path = self.cache_dir / aot.ARTIFACT
        start = time.perf_counter()
        if path.is_file():
            try:
                self._aot = aot.load(path, self.backend)
                self.stats.loaded = True
            except Exception as error:  # noqa: BLE001 (any failure: trace instead)
                logger.warning("could not load the saved forward %s (%s); tracing", path, error)
                self.backend.reset()
        if self._aot is None:
            # Trace and save, then compile what was saved the way a warm start loads it.
            try:
                aot.trace_and_save(self.model, input_ids, positions, self.backend, path)
                self.backend.reset()
                self._aot = aot.load(path, self.backend)
            except Exception as error:  # noqa: BLE001 (any failure: trace with torch.compile)
                logger.warning(
                    "ahead-of-time compile failed (%s); tracing with torch.compile", error
                )
                self.backend.reset()
                return None
        output = self._call_aot(input_ids, positions)
        self.trace_s = time.perf_counter() - start
        self._log_compiled()
        return output

    def _log_compiled(self) -> None:
        self.backend.allow_recompile = False
        logger.info(
            "compiled the forward: %s %.2f s, Inductor %.2f s (%d pieces, %d compiled, "
            "around %d attention ops)",
            "loaded the saved trace" if self.stats.loaded else "Dynamo",
            self.dynamo_s,
            self.stats.inductor_s,
            self.stats.num_pieces,
            self.stats.num_compiled,
            self.stats.num_splitting_ops,
        )
