"""EngineCore: the scheduler and the model runner, stepped together.

Runs in-process under `LLM` and inside the engine-core process under `AsyncEngine`. It speaks
only the typed messages of protocol.py.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import torch

from v1_engine.config import EngineConfig
from v1_engine.core.request import Request, RequestStatus
from v1_engine.core.sched_output import SchedulerOutput
from v1_engine.core.scheduler import Scheduler
from v1_engine.protocol import EngineCoreOutputs, EngineCoreRequest
from v1_engine.worker.model_runner import ModelRunner
from v1_engine.worker.step_output import StepOutput

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005
"""Longest a step with nothing to run waits for a structured-output grammar to compile."""


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        """`config` must already be resolved (see engine/prepare.py)."""
        self.config = config
        torch.manual_seed(config.model_config.seed)
        device = torch.device(config.resolve_device())
        start = time.perf_counter()
        self.model_runner = ModelRunner(config, device)
        self.num_kv_blocks = self.model_runner.determine_num_kv_blocks()
        self.model_runner.initialize_kv_cache(self.num_kv_blocks)
        self.async_scheduling = _use_async_scheduling(config, device)
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            config.model_config.max_model_len,
            self.num_kv_blocks,
            async_scheduling=self.async_scheduling,
        )
        self._in_flight: tuple[SchedulerOutput, StepOutput] | None = None
        """Async scheduling: the launched step whose output is collected by the next step()."""
        logger.info("engine core ready on %s in %.1f s", device, time.perf_counter() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        core_request = Request.from_engine_core_request(request)
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            # Compiled while the request waits; the scheduler admits it once done, so a slow
            # grammar holds back only its own request.
            core_request.grammar = self.model_runner.submit_grammar(structured)
        self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> EngineCoreOutputs:
        """Run one step and return its outputs.

        With async scheduling, step N+1 is scheduled and launched before step N's tokens are
        read back, and the outputs returned are step N's.
        """
        if not self.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        if not self.async_scheduling:
            scheduler_output = self._schedule()
            step = self.model_runner.execute_model(scheduler_output)
            return self._collect(scheduler_output, step)
        launched = None
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            launched = (scheduler_output, self.model_runner.execute_model(scheduler_output))
        in_flight, self._in_flight = self._in_flight, launched
        if in_flight is None:
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        return self._collect(*in_flight)

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            pending = self.scheduler.pending_grammars()
            if pending:
                # Only grammar compiles are left to wait for: block on them briefly instead
                # of spinning (the busy loop reads new requests between steps).
                concurrent.futures.wait(
                    pending, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
                )
        return scheduler_output

    def _collect(self, scheduler_output: SchedulerOutput, step: StepOutput) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(scheduler_output, step.get_output())
        outputs.timestamp = time.monotonic()
        return outputs


def _use_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """On by default where the device runs asynchronously to the host (CUDA); off with
    speculative decoding, whose next drafts wait for this step's accepted tokens."""
    requested = config.scheduler_config.async_scheduling
    if config.speculative_config.enabled:
        if requested is None and device.type == "cuda":
            logger.info("speculative decoding: async scheduling off (each step is settled first)")
        return False
    return device.type == "cuda" if requested is None else requested
