"""EngineCore: the scheduler and the model runner, stepped together.

Runs in-process under `LLM` and inside the engine-core process under `AsyncEngine`. It speaks
only the typed messages of protocol.py.
"""

from __future__ import annotations

import logging
import time

import torch

from v1_engine.config import EngineConfig
from v1_engine.core.request import Request, RequestStatus
from v1_engine.core.scheduler import Scheduler
from v1_engine.protocol import EngineCoreOutputs, EngineCoreRequest
from v1_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


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
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            config.model_config.max_model_len,
            self.num_kv_blocks,
        )
        logger.info("engine core ready on %s in %.1f s", device, time.perf_counter() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.timestamp = time.monotonic()
        return outputs
