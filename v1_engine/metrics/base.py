"""StatLoggerBase: the hook through which AsyncEngine reports scheduler and request statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from v1_engine.outputs import RequestOutput
    from v1_engine.protocol import SchedulerStats


class StatLoggerBase:
    """Receives the engine's statistics after every batch of core outputs it processes.

    AsyncEngine calls `record` from its output thread (not from the asyncio event loop), so an
    implementation must be thread-safe and quick: it runs on the path of every streamed token.
    """

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        outputs: list[RequestOutput],
        now: float,
    ) -> None:
        """`scheduler_stats` is the core's latest snapshot (None if the batch carried none);
        `outputs` are the RequestOutputs made from the batch (DELTA: only what is new, and the
        finished ones carry `finished=True` and complete `metrics`); `now` is `time.time()`."""
        raise NotImplementedError
