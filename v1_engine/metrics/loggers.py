"""LoggingStatLogger: the server's periodic INFO line of engine statistics (throughput, queue,
KV cache, prefix cache, preemptions, speculative decoding), as vLLM's operators read in its log.

Quiet when idle: a line is written only for an interval in which tokens were processed or
the core reported requests running or waiting. The server calls `record(None, [], now)` every
second as well (AsyncEngine.do_log_stats), so the last busy interval is logged when the work
stops, not at the next request.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from v1_engine.metrics.base import StatLoggerBase

if TYPE_CHECKING:
    from v1_engine.outputs import RequestOutput
    from v1_engine.protocol import SchedulerStats

logger = logging.getLogger("v1_engine.stats")

_MAX_TRACKED = 100_000
"""Requests whose prompt was counted, remembered until they finish (bounded)."""


class LoggingStatLogger(StatLoggerBase):
    """Logs one INFO line every `interval_s` seconds (of the `now` the engine passes) with the
    averages of the interval: prompt tokens (counted when a request's first output arrives, i.e.
    once its prefill is done) and generated tokens per second, running and waiting requests and
    the KV cache's use (latest), the prefix cache's hit rate over the prompt tokens looked up,
    preemptions, and with speculative decoding the share of draft tokens accepted and the mean
    acceptance length (tokens a verify step yields: 1 + accepted drafts per verify)."""

    def __init__(self, interval_s: float = 10.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._start: float | None = None
        self._latest: SchedulerStats | None = None
        self._reset()

    def _reset(self) -> None:
        self._prompt_tokens = self._generation_tokens = 0
        self._queries = self._hits = self._preempted = 0
        self._drafts = self._draft_tokens = self._accepted = 0
        self._fresh = False
        """Whether the core reported its queue in this interval (else the latest is stale)."""

    def record(
        self, scheduler_stats: SchedulerStats | None, outputs: list[RequestOutput], now: float
    ) -> None:
        with self._lock:
            if self._start is None:
                self._start = now
            if scheduler_stats is not None:
                s = self._latest = scheduler_stats
                self._fresh = True
                self._queries += s.prefix_cache_queries
                self._hits += s.prefix_cache_hits
                self._preempted += s.num_preempted_reqs
                self._drafts += s.spec_num_drafts
                self._draft_tokens += s.spec_num_draft_tokens
                self._accepted += s.spec_num_accepted_tokens
            for output in outputs:
                if output.request_id not in self._seen:
                    self._seen[output.request_id] = None
                    while len(self._seen) > _MAX_TRACKED:
                        self._seen.popitem(last=False)
                    self._prompt_tokens += len(output.prompt_token_ids or ())
                self._generation_tokens += sum(len(c.token_ids) for c in output.outputs)
                if output.finished:
                    self._seen.pop(output.request_id, None)
            elapsed = now - self._start
            if elapsed >= self.interval_s:
                line = self._line(elapsed)
                self._start = now
                self._reset()
                if line is not None:
                    logger.info(line)

    def _line(self, elapsed: float) -> str | None:
        """The interval's line, or None when nothing ran in it."""
        latest = self._latest if self._fresh else None
        running = latest.num_running_reqs if latest is not None else 0
        waiting = latest.num_waiting_reqs if latest is not None else 0
        if not (self._prompt_tokens or self._generation_tokens or running or waiting):
            return None
        usage = latest.kv_cache_usage if latest is not None else 0.0
        parts = [
            f"prompt throughput {self._prompt_tokens / elapsed:.1f} tok/s",
            f"generation throughput {self._generation_tokens / elapsed:.1f} tok/s",
            f"running {running} reqs",
            f"waiting {waiting} reqs",
            f"KV cache usage {100 * usage:.1f}%",
        ]
        if self._queries:
            parts.append(f"prefix cache hit rate {100 * self._hits / self._queries:.1f}%")
        if self._preempted:
            parts.append(f"preempted {self._preempted} reqs")
        line = "Engine: " + ", ".join(parts)
        if self._drafts:
            line += (
                f"; speculative decoding: {100 * self._accepted / self._draft_tokens:.1f}% of "
                f"{self._draft_tokens} draft tokens accepted, mean acceptance length "
                f"{1 + self._accepted / self._drafts:.2f}"
            )
        return line
