"""POST /v1/chat/completions: the conversation rendered by the model's chat template, n choices,
streamed as `chat.completion.chunk` events or returned whole. With a reasoning parser, a thinking
model's reasoning goes to `reasoning_content` and the rest is the content (which the tool-call
parser reads; reasoning_parsers.py says how a constrained output is read)."""

from __future__ import annotations

import dataclasses
import functools
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from v1_engine.entrypoints.errors import APIError, sse_error
from v1_engine.entrypoints.logprobs_format import chat_logprobs
from v1_engine.entrypoints.protocol_openai import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    UsageInfo,
    new_call_id,
)
from v1_engine.entrypoints.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningStreamer,
    parse_reasoning,
)
from v1_engine.entrypoints.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    ServerOptions,
    run_unless_disconnected,
    sse,
)
from v1_engine.entrypoints.tool_calls import ToolPlan, parse_required_calls, plan_tools
from v1_engine.entrypoints.tool_parsers import TOOL_PARSERS, ToolStreamer, parse_tool_calls
from v1_engine.outputs import CompletionOutput, RequestOutput
from v1_engine.sampling_params import SamplingParams


@dataclass
class ChatChoiceState:
    text: str = ""
    logprobs: list[ChatTokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    call_id: str | None = None
    """A named tool call's id, once its first delta went out (streaming)."""
    streamer: ToolStreamer | None = None
    """tool_choice "auto", streaming: the parser reading this choice's calls."""
    reasoner: ReasoningStreamer | None = None
    """Streaming with a reasoning parser: splits this choice's reasoning from its content."""
    num_calls: int = 0
    """Tool calls streamed so far (the next call's index)."""


@dataclass
class ChatUsage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def observe(self, output: RequestOutput) -> None:
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def usage(self, states: list[ChatChoiceState]) -> UsageInfo:
        """The usage so far; with a reasoning parser (the choices' reasoners), the reasoning's
        tokens too."""
        reasoners = [s.reasoner for s in states if s.reasoner is not None]
        details = None
        if reasoners:
            reasoning = sum(r.reasoning_tokens for r in reasoners)
            details = CompletionTokensDetails(reasoning_tokens=reasoning)
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
            completion_tokens_details=details,
        )


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: Any, options: ServerOptions | None = None) -> None:
        super().__init__(engine, options)
        self.tool_call_parser = self.options.tool_call_parser
        """Reads the calls of tool_choice "auto" (tool_parsers.TOOL_PARSERS); None refuses it."""
        self.reasoning_parser = self.options.reasoning_parser
        """Splits the reasoning off (reasoning_parsers.REASONING_PARSERS); None: no split."""

    async def create(self, body: ChatCompletionRequest, request: Request, request_id: str):
        self.check_request(body)
        token_ids, params = self._prepare(body)
        plan = plan_tools(body, self.tool_call_parser)  # checked by _prepare's sampling params
        if self.reasoning_parser is not None:
            plan, params = self._reasoning_plan(plan, token_ids, params)
            plan = dataclasses.replace(plan, include_reasoning=body.include_reasoning)
        response_id = f"chatcmpl-{request_id}"
        if body.stream:
            return StreamingResponse(
                self._stream(body, plan, token_ids, params, request_id, response_id),
                media_type="text/event-stream",
            )
        result = await run_unless_disconnected(
            request, lambda: self._full(body, plan, token_ids, params, request_id, response_id)
        )
        return JSONResponse(result.model_dump())

    def _prepare(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        messages = [m.flat() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        token_ids = self.render_chat(messages, body.chat_options(tools))
        field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        max_tokens = self.resolve_max_tokens(
            len(token_ids), body.requested_max_tokens(), field_name
        )
        params = self.sampling_params(body, max_tokens, tool_call_parser=self.tool_call_parser)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.validate(token_ids, params)
        return token_ids, params

    @functools.cached_property
    def _reasoning_tags(self) -> tuple[list[int], list[int]]:
        """The token ids of the reasoning parser's opening and closing tags."""
        assert self.reasoning_parser is not None
        reasoner = REASONING_PARSERS[self.reasoning_parser]
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        return encode(reasoner.START), encode(reasoner.END)

    def _reasoning_plan(
        self, plan: ToolPlan, token_ids: list[int], params: SamplingParams
    ) -> tuple[ToolPlan, SamplingParams]:
        """The plan with the reasoning split, and the params whose constraint (structured
        outputs, a forced call) waits for the reasoning's end, unless the prompt closed the
        block already: from the first token on where the model reasons from there
        (deepseek_r1), from an opening `<think>` as the first token where it may (qwen3, when
        the tag is one token; otherwise the constraint holds from the first token)."""
        assert self.reasoning_parser is not None
        reasoner = REASONING_PARSERS[self.reasoning_parser]
        structured = params.structured_outputs
        start, end = self._reasoning_tags
        if structured is not None and _last_index(token_ids, end) <= _last_index(token_ids, start):
            if reasoner.opens_in_prompt:
                structured = msgspec.structs.replace(structured, reasoning_end=end)
            elif len(start) == 1:
                structured = msgspec.structs.replace(
                    structured, reasoning_end=end, reasoning_start=start[0]
                )
            params = msgspec.structs.replace(params, structured_outputs=structured)
        constrained = structured is not None and structured.reasoning_end is None
        plan = dataclasses.replace(
            plan,
            reasoning=self.reasoning_parser,
            constrained=constrained,
            reasoning_end_ids=tuple(self._reasoning_tags[1]),
        )
        return plan, params

    def _fold(
        self, body: ChatCompletionRequest, state: ChatChoiceState, completion: CompletionOutput
    ) -> list[ChatTokenLogprob] | None:
        state.text += completion.text
        new_logprobs = None
        if body.logprobs and completion.logprobs:
            new_logprobs = chat_logprobs(
                completion.token_ids, completion.logprobs, body.top_logprobs or 0, self.tokenizer
            )
            state.logprobs.extend(new_logprobs)
        if completion.finish_reason is not None:
            state.finish_reason = completion.finish_reason
            state.stop_reason = completion.stop_reason
        return new_logprobs

    async def _full(
        self,
        body: ChatCompletionRequest,
        plan: ToolPlan,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        response_id: str,
    ) -> ChatCompletionResponse:
        states = [ChatChoiceState() for _ in range(body.n)]
        usage = ChatUsage()
        async for output in self.stream_outputs(token_ids, params, request_id, body.priority):
            usage.observe(output)
            for completion in output.outputs:
                state = states[completion.index]
                self._fold(body, state, completion)
                _split_reasoning(plan, state, completion)  # counts the reasoning's tokens
        choices = []
        for i, s in enumerate(states):
            message, finish_reason = _message(plan, s)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=ChatChoiceLogprobs(content=s.logprobs) if body.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=response_id,
            model=self.served_model_name,
            choices=choices,
            usage=usage.usage(states),
        )

    async def _stream(
        self,
        body: ChatCompletionRequest,
        plan: ToolPlan,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        response_id: str,
    ) -> AsyncIterator[str]:
        states = [ChatChoiceState() for _ in range(body.n)]
        usage = ChatUsage()
        options = body.stream_options
        continuous = bool(options and options.continuous_usage_stats)

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(
                ChatCompletionChunk(
                    id=response_id,
                    model=self.served_model_name,
                    choices=[choice],
                    usage=usage.usage(states) if continuous else None,
                )
            )

        try:
            for i in range(body.n):
                yield chunk(
                    ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                )
            async for output in self.stream_outputs(token_ids, params, request_id, body.priority):
                usage.observe(output)
                for completion in output.outputs:
                    state = states[completion.index]
                    new_logprobs = self._fold(body, state, completion)
                    choice = _stream_choice(plan, state, completion, new_logprobs)
                    if choice is not None:
                        if not body.logprobs:
                            choice.logprobs = None
                        yield chunk(choice)
            if options and options.include_usage:
                yield sse(
                    ChatCompletionChunk(
                        id=response_id,
                        model=self.served_model_name,
                        choices=[],
                        usage=usage.usage(states),
                    )
                )
        except APIError as e:
            yield sse_error(e)
        yield SSE_DONE


def _stream_choice(
    plan: ToolPlan,
    state: ChatChoiceState,
    completion: CompletionOutput,
    new_logprobs: list[ChatTokenLogprob] | None,
) -> ChatStreamChoice | None:
    """A choice's next streamed chunk for its new output (None: nothing to send yet): its
    text, reasoning and tool-call deltas as the plan reads them, the logprobs of its tokens,
    and its finish reason once it ends."""
    reasoning, text = _split_reasoning(plan, state, completion)
    if plan.mode == "required":
        # The calls are read from the whole array: sent when it is complete.
        if completion.finish_reason is None:
            return None
        delta, finish_reason = _required_delta(plan, state)
        new_logprobs, reasoning = state.logprobs, ""  # the delta has it all
    elif plan.mode == "auto":
        delta, finish_reason = _auto_delta(plan, state, text, completion.finish_reason)
        if delta is None and not new_logprobs and not reasoning:
            return None
        delta = delta or DeltaMessage()
    else:
        finish_reason = completion.finish_reason
        if not text and not reasoning and finish_reason is None and not new_logprobs:
            return None
        delta = _text_delta(plan, state, text) if text or not reasoning else DeltaMessage()
    if reasoning:
        delta.reasoning_content = reasoning
    return ChatStreamChoice(
        index=completion.index,
        delta=delta,
        logprobs=ChatChoiceLogprobs(content=new_logprobs),
        finish_reason=finish_reason,
        stop_reason=completion.stop_reason,
    )


def _last_index(tokens: list[int], seq: list[int]) -> int:
    """Where `seq` last occurs in `tokens` (-1: nowhere); a byte search over the ids."""
    haystack, needle = array("i", tokens).tobytes(), array("i", seq).tobytes()
    at = haystack.rfind(needle)
    while at > 0 and at % 4:  # a match across token boundaries: look further back
        at = haystack.rfind(needle, 0, at + len(needle) - 1)
    return at // 4 if at >= 0 else -1


def _split_reasoning(
    plan: ToolPlan, state: ChatChoiceState, completion: CompletionOutput
) -> tuple[str, str]:
    """The (reasoning, answer) pieces of a choice's new text (streaming; whole replies feed it
    too, as the choice's reasoner counts the reasoning's tokens)."""
    if plan.reasoning is None:
        return "", completion.text
    if state.reasoner is None:
        state.reasoner = REASONING_PARSERS[plan.reasoning](plan.constrained, plan.reasoning_end_ids)
    reasoning, text = state.reasoner.feed(completion.text, completion.token_ids)
    if completion.finish_reason is not None:
        more_reasoning, more_text = state.reasoner.finish()
        reasoning, text = reasoning + more_reasoning, text + more_text
    return (reasoning if plan.include_reasoning else ""), text


def _message(plan: ToolPlan, state: ChatChoiceState) -> tuple[ChatResponseMessage, str | None]:
    """A choice's whole message and finish reason: its text, or the tool calls it holds (and
    its reasoning, with a reasoning parser)."""
    if plan.reasoning is None:
        return _answer(plan, state, state.text)
    reasoning, text = parse_reasoning(plan.reasoning, state.text, plan.constrained)
    message, finish_reason = _answer(plan, state, text)
    message.reasoning_content = reasoning if plan.include_reasoning else None
    if message.content == "" and reasoning is not None:
        message.content = None  # cut while reasoning: no answer yet
    return message, finish_reason


def _answer(
    plan: ToolPlan, state: ChatChoiceState, text: str
) -> tuple[ChatResponseMessage, str | None]:
    """The message of the answer `text`: content, or the tool calls it holds."""
    if plan.mode == "named":
        assert plan.name is not None
        call = ToolCall(function=FunctionCall(name=plan.name, arguments=text))
        return ChatResponseMessage(content=None, tool_calls=[call]), state.finish_reason
    if plan.mode == "required":
        calls = parse_required_calls(text)
        if calls is not None:
            tool_calls = [ToolCall(function=FunctionCall(name=n, arguments=a)) for n, a in calls]
            finish_reason = "tool_calls" if state.finish_reason == "stop" else state.finish_reason
            return ChatResponseMessage(content=None, tool_calls=tool_calls), finish_reason
        # Cut before the array closed (max_tokens): the text as it is.
    if plan.mode == "auto":
        assert plan.parser is not None
        parsed = parse_tool_calls(plan.parser, text)
        if parsed.calls:
            tool_calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls]  # fmt: skip
            finish_reason = "tool_calls" if state.finish_reason == "stop" else state.finish_reason
            content = parsed.content.strip() or None
            return ChatResponseMessage(content=content, tool_calls=tool_calls), finish_reason
    return ChatResponseMessage(content=text), state.finish_reason


def _required_delta(plan: ToolPlan, state: ChatChoiceState) -> tuple[DeltaMessage, str | None]:
    """tool_choice "required", streaming: the finished choice's calls, one delta each (or its
    text, when the array was cut)."""
    message, finish_reason = _message(plan, state)
    calls = [
        DeltaToolCall(
            index=j,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
        )
        for j, call in enumerate(message.tool_calls)
    ]
    delta = DeltaMessage(content=message.content, reasoning_content=message.reasoning_content)
    delta.tool_calls = calls or None
    return delta, finish_reason


def _auto_delta(
    plan: ToolPlan, state: ChatChoiceState, text: str, finish_reason: str | None
) -> tuple[DeltaMessage | None, str | None]:
    """tool_choice "auto", streaming: the content the parser lets through and the call deltas it
    has read (a call's first delta carries its id and name, later ones pieces of its
    arguments); None when it holds everything back. The finish reason is "tool_calls" when the
    choice called any tool."""
    if state.streamer is None:
        assert plan.parser is not None
        state.streamer = TOOL_PARSERS[plan.parser]()
    parsed = state.streamer.feed(text)
    if finish_reason is not None:
        parsed.extend(state.streamer.finish())
    calls = []
    for piece in parsed.deltas:
        if piece.name is None:
            function = DeltaFunctionCall(arguments=piece.arguments)
            calls.append(DeltaToolCall(index=state.num_calls - 1, function=function))
            continue
        function = DeltaFunctionCall(name=piece.name, arguments=piece.arguments)
        calls.append(DeltaToolCall(index=state.num_calls, id=new_call_id(), type="function", function=function))  # fmt: skip
        state.num_calls += 1
    if finish_reason == "stop" and state.num_calls:
        finish_reason = "tool_calls"
    if not parsed.content and not calls and finish_reason is None:
        return None, None
    return DeltaMessage(content=parsed.content or None, tool_calls=calls or None), finish_reason


def _text_delta(plan: ToolPlan, state: ChatChoiceState, text: str) -> DeltaMessage:
    """A streamed piece of a choice's text; for a named tool call, a piece of its arguments (the
    first one carries the call's id and name)."""
    if plan.mode != "named":
        return DeltaMessage(content=text)
    function = DeltaFunctionCall(arguments=text)
    if state.call_id is not None:
        return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=function)])
    state.call_id = new_call_id()
    function.name = plan.name
    call = DeltaToolCall(index=0, id=state.call_id, type="function", function=function)
    return DeltaMessage(tool_calls=[call])
