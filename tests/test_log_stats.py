"""The server's periodic statistics line (metrics/loggers.py): the interval's averages, the
latest queue and KV cache, hit rate and drafts; nothing for an idle interval."""

from __future__ import annotations

import logging

import pytest

from v1_engine.metrics.loggers import LoggingStatLogger
from v1_engine.outputs import CompletionOutput, RequestOutput
from v1_engine.protocol import SchedulerStats


def output(request_id: str, num_prompt: int, num_new: int, finished: bool = False):
    completion = CompletionOutput(0, "x" * num_new, [7] * num_new, None, None)
    return RequestOutput(request_id, None, [1] * num_prompt, None, [completion], finished)


def test_a_line_per_interval_with_the_interval_averages(caplog):
    caplog.set_level(logging.INFO, logger="v1_engine.stats")
    stats = LoggingStatLogger(interval_s=10.0)
    busy = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                          prefix_cache_queries=100, prefix_cache_hits=40)  # fmt: skip
    stats.record(busy, [output("a", 30, 1), output("b", 70, 1)], now=100.0)
    stats.record(None, [output("a", 30, 4), output("b", 70, 5, finished=True)], now=105.0)
    drafts = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.125, num_preempted_reqs=1,
                            spec_num_drafts=4, spec_num_draft_tokens=12,
                            spec_num_accepted_tokens=9)  # fmt: skip
    assert not caplog.records  # 9 s: not yet
    stats.record(drafts, [output("a", 30, 10)], now=110.0)
    (line,) = [r.getMessage() for r in caplog.records]
    # 100 prompt tokens (each prompt once) and 21 generated tokens over 10 s.
    assert line == (
        "Engine: prompt throughput 10.0 tok/s, generation throughput 2.1 tok/s, running 1 reqs, "
        "waiting 0 reqs, KV cache usage 12.5%, prefix cache hit rate 40.0%, preempted 1 reqs; "
        "speculative decoding: 75.0% of 12 draft tokens accepted, mean acceptance length 3.25"
    )
    caplog.clear()
    # The next interval starts afresh: request "a" was counted before, "c" is new.
    stats.record(SchedulerStats(num_running_reqs=2), [output("a", 30, 2), output("c", 5, 1)], 115.0)
    stats.record(None, [], now=120.0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("Engine: prompt throughput 0.5 tok/s, generation throughput 0.3 tok/s")
    assert "prefix cache" not in line and "speculative" not in line


def test_quiet_when_idle(caplog):
    caplog.set_level(logging.INFO, logger="v1_engine.stats")
    stats = LoggingStatLogger(interval_s=1.0)
    for now in range(10):
        stats.record(SchedulerStats(), [], now=float(now))
    assert not caplog.records
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        LoggingStatLogger(0)


def test_cli_flags():
    from v1_engine.entrypoints.cli import main, make_parser, with_log_stats

    (logger,) = with_log_stats(make_parser().parse_args(["--log-stats-interval", "2.5"]), [])
    assert isinstance(logger, LoggingStatLogger) and logger.interval_s == 2.5
    assert with_log_stats(make_parser().parse_args(["--disable-log-stats"]), ["x"]) == ["x"]
    with pytest.raises(SystemExit):
        main(["--log-stats-interval", "0"])


def test_the_last_busy_interval_is_logged_when_the_work_stops(caplog):
    """The server's once-a-second tick (no outputs, no stats) ends the interval in which the
    last request finished; after it, a stale queue snapshot does not keep the log going."""
    caplog.set_level(logging.INFO, logger="v1_engine.stats")
    stats = LoggingStatLogger(interval_s=10.0)
    stats.record(SchedulerStats(num_running_reqs=1), [output("a", 20, 1)], now=0.0)
    stats.record(SchedulerStats(num_running_reqs=1), [output("a", 20, 4, finished=True)], now=3.0)
    for now in range(4, 10):
        stats.record(None, [], now=float(now))
    assert not caplog.records
    stats.record(None, [], now=10.0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("Engine: prompt throughput 2.0 tok/s, generation throughput 0.5 tok/s")
    assert "running 1 reqs" in line
    caplog.clear()
    for now in range(11, 40):
        stats.record(None, [], now=float(now))
    assert not caplog.records  # idle: the last snapshot's "running 1" is not repeated


def test_the_engine_ticks_its_stat_loggers():
    from v1_engine.engine.async_engine import AsyncEngine

    class Recorder:
        def __init__(self):
            self.calls = []

        def record(self, scheduler_stats, outputs, now):
            self.calls.append((scheduler_stats, outputs))

    engine = AsyncEngine.__new__(AsyncEngine)  # the tick alone: no core process needed
    import threading

    engine._lock, engine.stat_loggers = threading.Lock(), [Recorder()]
    engine.do_log_stats()
    assert engine.stat_loggers[0].calls == [(None, [])]
