"""POST /v1/completions: one or more prompts, n completions each, streamed or not.

Choice indices follow OpenAI: prompt i's completion j is choice i * n + j. Each prompt is one
engine request (`{request_id}-{i}`), so a batch of prompts runs concurrently in the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from v1_engine.entrypoints.errors import APIError, sse_error
from v1_engine.entrypoints.logprobs_format import append_completion_logprobs
from v1_engine.entrypoints.protocol_openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from v1_engine.entrypoints.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    merge_streams,
    run_unless_disconnected,
    sse,
)
from v1_engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from v1_engine.sampling_params import SamplingParams


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    text: str
    params: SamplingParams


@dataclass
class ChoiceState:
    """Everything one choice accumulates across deltas."""

    text: str = ""
    num_tokens: int = 0
    text_offset: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


@dataclass
class UsageCounter:
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def observe(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(self.cached_tokens.values())
            ),
        )


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, body: CompletionRequest, request: Request, request_id: str):
        self.check_request(body)
        prompts = self._prepare(body)
        response_id = f"cmpl-{request_id}"
        if body.stream:
            return StreamingResponse(
                self._stream(body, prompts, request_id, response_id),
                media_type="text/event-stream",
            )
        result = await run_unless_disconnected(
            request, lambda: self._full(body, prompts, request_id, response_id)
        )
        return JSONResponse(result.model_dump())

    def _prepare(self, body: CompletionRequest) -> list[PreparedPrompt]:
        raw_prompts = body.prompts()
        if not raw_prompts:
            raise APIError("prompt must not be empty", param="prompt")
        prepared = []
        for raw in raw_prompts:
            token_ids = self.tokenize_prompt(raw)
            max_tokens = self.resolve_max_tokens(len(token_ids), body.max_tokens, "max_tokens")
            params = self.sampling_params(body, max_tokens)
            self.validate(token_ids, params)
            text = raw if isinstance(raw, str) else self.tokenizer.decode(token_ids)
            prepared.append(PreparedPrompt(token_ids, text, params))
        return prepared

    def _streams(self, prompts: list[PreparedPrompt], request_id: str, priority: int):
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        return merge_streams(
            [
                self.stream_outputs(p.token_ids, p.params, rid, priority)
                for p, rid in zip(prompts, ids)
            ]
        )

    def _apply(
        self,
        body: CompletionRequest,
        prompt: PreparedPrompt,
        choice: ChoiceState,
        completion: CompletionOutput,
        prompt_logprobs: PromptLogprobs | None,
    ) -> tuple[str, CompletionLogprobs | None]:
        """Fold one delta into the choice; return the delta's text and logprobs (with the echoed
        prompt in front on the first delta)."""
        text, delta_lp = "", None
        want_lp = body.logprobs is not None
        if want_lp:
            delta_lp = CompletionLogprobs()
        if not choice.started and (completion.token_ids or completion.finish_reason):
            # Prefill is complete once a token exists, so prompt logprobs are too.
            choice.started = True
            if body.echo:
                text = prompt.text
                if want_lp:
                    rows = prompt_logprobs or [None] * len(prompt.token_ids)
                    choice.text_offset = append_completion_logprobs(
                        delta_lp, prompt.token_ids, rows, body.logprobs, self.tokenizer, 0
                    )
                else:
                    choice.text_offset = len(text)
        text += completion.text
        if want_lp and completion.logprobs:
            choice.text_offset = append_completion_logprobs(
                delta_lp,
                completion.token_ids,
                completion.logprobs,
                body.logprobs,
                self.tokenizer,
                choice.text_offset,
            )
        choice.text += text
        choice.num_tokens += len(completion.token_ids)
        if delta_lp is not None:
            if choice.logprobs is None:
                choice.logprobs = CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(choice.logprobs, name).extend(getattr(delta_lp, name))
        if completion.finish_reason is not None:
            choice.finish_reason = completion.finish_reason
            choice.stop_reason = completion.stop_reason
        return text, delta_lp

    async def _full(
        self,
        body: CompletionRequest,
        prompts: list[PreparedPrompt],
        request_id: str,
        response_id: str,
    ) -> CompletionResponse:
        choices = [ChoiceState() for _ in range(len(prompts) * body.n)]
        usage = UsageCounter()
        async for prompt_index, output in self._streams(prompts, request_id, body.priority):
            usage.observe(prompt_index, output)
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                self._apply(
                    body, prompts[prompt_index], choices[index], completion, output.prompt_logprobs
                )
        return CompletionResponse(
            id=response_id,
            model=self.served_model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.text,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage.usage(),
        )

    async def _stream(
        self,
        body: CompletionRequest,
        prompts: list[PreparedPrompt],
        request_id: str,
        response_id: str,
    ) -> AsyncIterator[str]:
        choices = [ChoiceState() for _ in range(len(prompts) * body.n)]
        usage = UsageCounter()
        options = body.stream_options
        try:
            async for prompt_index, output in self._streams(prompts, request_id, body.priority):
                usage.observe(prompt_index, output)
                for completion in output.outputs:
                    index = prompt_index * body.n + completion.index
                    choice = choices[index]
                    text, delta_lp = self._apply(
                        body, prompts[prompt_index], choice, completion, output.prompt_logprobs
                    )
                    if not text and completion.finish_reason is None and not delta_lp:
                        continue
                    chunk = CompletionResponse(
                        id=response_id,
                        model=self.served_model_name,
                        choices=[
                            CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=delta_lp,
                                finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason,
                            )
                        ],
                        usage=usage.usage() if options and options.continuous_usage_stats else None,
                    )
                    yield sse(chunk)
            if options and options.include_usage:
                yield sse(
                    CompletionResponse(
                        id=response_id,
                        model=self.served_model_name,
                        choices=[],
                        usage=usage.usage(),
                    )
                )
        except APIError as e:
            yield sse_error(e)
        yield SSE_DONE
