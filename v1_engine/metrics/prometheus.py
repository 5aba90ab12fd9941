"""PrometheusStatLogger: the engine's statistics as Prometheus metrics in the `v1engine:` namespace.

Names mirror vLLM's (`vllm:` → `v1engine:`), so existing dashboards need only the prefix
changed. Every logger owns its CollectorRegistry: two engines in one process (tests) never
collide, and /metrics exports exactly this engine's series.

Scheduler gauges and prefix-cache counters come from SchedulerStats; token counters and latency
histograms come from the DELTA RequestOutputs, tracked per completion (request id, index).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from v1_engine.metrics.base import StatLoggerBase
from v1_engine.outputs import CompletionOutput, RequestOutput
from v1_engine.protocol import SchedulerStats

# The `*_created` timestamp series double the exposition and no dashboard reads them.
disable_created_metrics()

NAMESPACE = "v1engine"
FINISH_REASONS = ("stop", "length", "abort")
_MAX_TRACKED = 100_000
"""Completions whose timing state is kept; an aborted one may never report finished."""

# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass
class _CompletionTiming:
    last_token_time: float | None = None


class PrometheusStatLogger(StatLoggerBase):
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._lock = threading.Lock()
        self._timings: OrderedDict[tuple[str, int], _CompletionTiming] = OrderedDict()
        self._seen_prompts: OrderedDict[str, None] = OrderedDict()
        self._build_metrics()

    def _name(self, suffix: str) -> str:
        return f"{NAMESPACE}:{suffix}"

    def _build_metrics(self) -> None:
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(self._name(name), doc, labels, registry=reg).labels(self.model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(self._name(name), doc, labels, registry=reg).labels(self.model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(self._name(name), doc, labels, buckets=buckets, registry=reg)
            return metric.labels(self.model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.spec_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative decoding: requests' verify steps with drafts."
        )
        self.spec_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."
        )
        self.spec_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests served.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter(
            self._name("request_success"),
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.request_success = {r: success.labels(self.model_name, r) for r in FINISH_REASONS}
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between successive token outputs.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish.", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduling.", _REQUEST_BUCKETS
        )

    def record(
        self, scheduler_stats: SchedulerStats | None, outputs: list[RequestOutput], now: float
    ) -> None:
        with self._lock:
            if scheduler_stats is not None:
                self._record_scheduler(scheduler_stats)
            for output in outputs:
                self._record_output(output, now)

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preempted_reqs)
        self.spec_num_drafts.inc(stats.spec_num_drafts)
        self.spec_num_draft_tokens.inc(stats.spec_num_draft_tokens)
        self.spec_num_accepted_tokens.inc(stats.spec_num_accepted_tokens)

    def _record_output(self, output: RequestOutput, now: float) -> None:
        if output.request_id not in self._seen_prompts:
            self._remember(self._seen_prompts, output.request_id, None)
            self.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self._record_completion(output, completion, now)
        if output.finished:
            self._seen_prompts.pop(output.request_id, None)

    def _record_completion(
        self, output: RequestOutput, completion: CompletionOutput, now: float
    ) -> None:
        key = (output.request_id, completion.index)
        timing = self._timings.get(key)
        if timing is None:
            timing = _CompletionTiming()
            self._remember(self._timings, key, timing)
        num_new = len(completion.token_ids)
        if num_new:
            self.generation_tokens.inc(num_new)
            if timing.last_token_time is None:
                metrics = output.metrics
                if metrics is not None:
                    first = metrics.first_token_time or now
                    self.ttft.observe(max(0.0, first - metrics.arrival_time))
            else:
                self.itl.observe(max(0.0, now - timing.last_token_time))
            timing.last_token_time = now
        if completion.finish_reason is not None:
            self._record_finished(output, completion, now)
            self._timings.pop(key, None)

    def _record_finished(
        self, output: RequestOutput, completion: CompletionOutput, now: float
    ) -> None:
        reason = str(completion.finish_reason)
        if reason in self.request_success:
            self.request_success[reason].inc()
        metrics = output.metrics
        if metrics is None:
            return
        self.e2e.observe(max(0.0, (metrics.finished_time or now) - metrics.arrival_time))
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))

    @staticmethod
    def _remember(store: OrderedDict, key, value) -> None:
        store[key] = value
        while len(store) > _MAX_TRACKED:
            store.popitem(last=False)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)
