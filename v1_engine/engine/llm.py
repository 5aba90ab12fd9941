"""LLM: the offline API, `llm.generate(prompts, sampling_params)`, with an in-process core."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from v1_engine.config import EngineConfig
from v1_engine.engine.core import EngineCore
from v1_engine.engine.input_processor import ChatMessages, ChatOptions, InputProcessor, PromptType
from v1_engine.engine.output_processor import OutputKind, OutputProcessor, ParentRequest
from v1_engine.engine.prepare import prepare_engine_config
from v1_engine.models.loader import get_tokenizer
from v1_engine.outputs import RequestOutput
from v1_engine.protocol import EngineCoreRequest
from v1_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Generate text for batches of prompts, offline.

    `model=None` loads the embedded default model (SmolLM2-135M-Instruct). Keyword arguments
    use vLLM's names and are routed to the EngineConfig sections (see config.py).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        load_format: str = "auto",
        **kwargs: Any,
    ) -> None:
        self.config = EngineConfig.from_kwargs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            load_format=load_format,
            **kwargs,
        )
        hf_config = prepare_engine_config(self.config)
        self.tokenizer = get_tokenizer(self.config.model_config.tokenizer)
        self.input_processor = InputProcessor(self.config, self.tokenizer, hf_config.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(self.config)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params samples with: the model's recommended sampling
        (its generation_config.json; `generation_config="vllm"`: SamplingParams())."""
        return self.input_processor.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are a str, a list of str, or a list of token-id lists; outputs keep order.
        `priority`, one int per prompt, orders them under the priority scheduling policy
        (lower first)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        tokenized = []
        for i, prompt in enumerate(prompts):
            try:
                tokenized.append(self.input_processor.tokenize(prompt))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        return self._run(tokenized, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {'role', 'content'}) or a list of them, through the
        model's chat template; `tools` (OpenAI function tools) reach templates that render
        them, `chat_template_kwargs` are template variables (`{"enable_thinking": False}`), and
        `continue_final_message` (with add_generation_prompt=False) lets the model continue the
        last, assistant message; `chat_template` (a Jinja template) replaces the model's for
        this call; `priority` as in generate(). The output is the model's text: read calls with
        `v1_engine.entrypoints.tool_parsers.parse_tool_calls(parser, text)`, reasoning with
        `v1_engine.entrypoints.reasoning_parsers.parse_reasoning(parser, text)`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = ChatOptions(add_generation_prompt, tools, continue_final_message,
                              chat_template_kwargs, chat_template)  # fmt: skip
        tokenized = []
        for i, conversation in enumerate(conversations):
            try:
                tokenized.append(self.input_processor.chat_token_ids(conversation, options))
            except ValueError as e:
                raise ValueError(f"messages[{i}]: {e}") from None
        return self._run(tokenized, sampling_params, use_tqdm, priority)

    def _run(
        self,
        tokenized: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        params_list = self._params_per_prompt(sampling_params, len(tokenized))
        if priority is not None and len(priority) != len(tokenized):
            raise ValueError(
                f"priority must hold one int per prompt ({len(tokenized)}), got {len(priority)}"
            )
        priorities = [0] * len(tokenized) if priority is None else list(priority)
        # Validate everything before adding anything: a bad prompt leaves the engine untouched.
        requests = []
        for i, ((prompt, token_ids), params) in enumerate(zip(tokenized, params_list)):
            request_id = str(next(self._request_counter))
            try:
                core = self._core_requests(request_id, token_ids, params, priorities[i])
                requests.append((prompt, core))
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: {e}") from None
        order = {}
        for i, (prompt, (parent, core_requests)) in enumerate(requests):
            order[parent.request_id if parent else core_requests[0].request_id] = i
            for index, core_request in enumerate(core_requests):
                self.output_processor.add_request(
                    core_request, prompt, OutputKind.FINAL_ONLY, parent, index
                )
                self.engine_core.add_request(core_request)
        return self._run_engine(order, use_tqdm)

    def _core_requests(
        self, request_id: str, token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
        core_requests = self.input_processor.process_fan_out(
            request_id, token_ids, params, priority=priority
        )
        parent = ParentRequest(request_id, params.n) if params.n > 1 else None
        return parent, core_requests

    def _run_engine(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, unit="req")
        with bar:
            while self.engine_core.has_unfinished_requests():
                processed = self.output_processor.process_outputs(self.engine_core.step())
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                for output in processed.request_outputs:
                    if output.finished:
                        results[order[output.request_id]] = output
                        bar.update(1)
        assert all(r is not None for r in results), "engine stopped with requests unfinished"
        return results  # type: ignore[return-value]

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"sampling_params must be one SamplingParams or one per prompt "
                f"({num_prompts}), got {len(sampling_params)}"
            )
        return list(sampling_params)
