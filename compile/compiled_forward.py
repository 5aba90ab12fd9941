"""The model forward behind torch.compile: traced once, never recompiled while serving."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

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
    ) -> None:
        self.model = model
        self.backend = PiecewiseBackend(splitting_ops, passes, use_inductor, cudagraphs)
        self._compiled = torch.compile(model, backend=self.backend, fullgraph=True)
        self.trace_s = 0.0
        """Wall time of the first call: Dynamo tracing plus the backend's Inductor work."""

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
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._compiled(input_ids, positions)

    def _trace(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
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
        self.backend.allow_recompile = False
        logger.info(
            "compiled the forward: Dynamo %.2f s, Inductor %.2f s (%d pieces, %d compiled, "
            "around %d attention ops)",
            self.dynamo_s,
            self.stats.inductor_s,
            self.stats.num_pieces,
            self.stats.num_compiled,
            self.stats.num_splitting_ops,
        )
        return output
