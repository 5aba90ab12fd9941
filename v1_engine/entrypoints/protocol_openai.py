"""Pydantic models of the OpenAI-compatible HTTP API: requests, responses and stream chunks.

Requests forbid unknown fields, so a typo (`max_token`) is a 400 naming the field instead of
a silently ignored option. Types and simple ranges live here (pydantic reports the field);
the sampling ranges are checked once, by SamplingParams.verify(), after conversion.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from v1_engine.engine.input_processor import ChatOptions
from v1_engine.sampling_params import SamplingParams
from v1_engine.structured_output import StructuredOutputsParams

MAX_N = 128
"""Most completions one request may ask for."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(StrictModel):
    include_usage: bool = False
    """Send one last chunk with the request's token usage (and empty choices)."""
    continuous_usage_stats: bool = False
    """Attach the running usage to every chunk."""


class JsonSchemaFormat(StrictModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    """The JSON schema (OpenAI's `schema`; true or absent: any JSON value)."""
    strict: bool | None = None
    """Accepted; the schema is always enforced."""


class ResponseFormat(StrictModel):
    """OpenAI's output format: "text" (no constraint, the default), "json_object" (any JSON
    object) or "json_schema" (JSON valid under `json_schema.schema`), enforced through
    structured outputs (v1_engine/structured_output.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(StrictModel):
    """Fields shared by completions and chat; the extra ones follow vLLM's names."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """Token id -> bias in [-100, 100] added to its logit (JSON keys are strings of digits,
    OpenAI's form; pydantic parses them, and names the field when one is not an integer)."""
    allowed_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older names for structured_outputs' json / regex / choice / grammar."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted for compatibility; not used."""
    priority: int = 0
    """Under --scheduling-policy priority: lower runs sooner (vLLM's extra field)."""

    def base_sampling_kwargs(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """The SamplingParams fields the client set; unset ones take `defaults` (the model's
        recommended sampling) or else keep SamplingParams' defaults."""
        names = (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
        kwargs: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in names}
        kwargs.update((k, getattr(self, k)) for k in names if getattr(self, k) is not None)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        kwargs.update(
            n=self.n,
            stop=stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=self.structured_outputs_params(),
        )
        return kwargs

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for, checked (ValueError naming the
        request's field: a bad schema, regex or grammar, or two constraints at once)."""
        sources: list[tuple[str, StructuredOutputsParams]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            sources.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError('response_format.json_schema is required for type "json_schema"')
            schema = StructuredOutputsParams(json=fmt.json_schema.schema_)
            sources.append(("response_format.json_schema.schema", schema))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            # (a schema given as a dict is serialized by StructuredOutputsParams)
            params = StructuredOutputsParams(
                json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                choice=so.choice, grammar=so.grammar,
            )  # fmt: skip
            sources.append(("structured_outputs", params))
        if self.guided_json is not None:
            guided = StructuredOutputsParams(json=self.guided_json)
            sources.append(("guided_json", guided))
        if self.guided_regex is not None:
            sources.append(("guided_regex", StructuredOutputsParams(regex=self.guided_regex)))
        if self.guided_choice is not None:
            sources.append(("guided_choice", StructuredOutputsParams(choice=self.guided_choice)))
        if self.guided_grammar is not None:
            sources.append(("guided_grammar", StructuredOutputsParams(grammar=self.guided_grammar)))
        if not sources:
            return None
        if len(sources) > 1:
            names = " and ".join(name for name, _ in sources)
            raise ValueError(
                f"{sources[0][0]} conflicts: {names} each constrain the output; set one"
            )
        name, params = sources[0]
        try:
            params.verify()
        except ValueError as e:
            message = str(e)
            if name != "structured_outputs":
                message = re.sub(r"^structured_outputs(\.[a-z_]+)?", name, message)
            raise ValueError(message) from None
        return params


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a batch of strings or token lists, or a single prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(
        self, max_tokens: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        kwargs = self.base_sampling_kwargs(defaults)
        if self.echo and self.logprobs is not None:
            kwargs["prompt_logprobs"] = self.logprobs
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **kwargs)


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(ResponseModel):
    name: str
    arguments: str
    """The arguments as a JSON object in text (OpenAI's form)."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(ResponseModel):
    id: str = Field(default_factory=new_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallMessage(StrictModel):
    name: str
    arguments: str


class ToolCallMessage(StrictModel):
    """A tool call of an earlier assistant turn, as a client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallMessage


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    """An assistant turn's tool calls."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""

    def flat(self) -> dict[str, Any]:
        """The dict a chat template expects: text parts joined by newlines; tool calls with
        their arguments as objects (what templates iterate over), the tool turn's call id."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments_object(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


def _arguments_object(arguments: str) -> Any:
    """A tool call's JSON arguments as an object; text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema; absent: any JSON object."""
    strict: bool | None = None
    """Accepted; the schema is always enforced when the call is forced."""


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(StrictModel):
    """How a chat request's conversation is rendered (chat completions and /tokenize)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Render the last (assistant) message open for the model to continue (needs
    add_generation_prompt false)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template, e.g. `{"enable_thinking": false}` (Qwen3)."""
    chat_template: str | None = None
    """A Jinja chat template for this request instead of the model's (refused unless the server
    runs with --trust-request-chat-template)."""

    def chat_options(self, tools: list[dict[str, Any]] | None = None) -> ChatOptions:
        return ChatOptions(
            self.add_generation_prompt,
            tools,
            self.continue_final_message,
            self.chat_template_kwargs,
            self.chat_template,
        )


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    """Deprecated by OpenAI in favour of max_completion_tokens; both are accepted."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    include_reasoning: bool = True
    """With a reasoning parser: false leaves `reasoning_content` out (the answer is the same)."""
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """"none" (plain text), "required" (one or more calls of the tools), or a named function
    (one call of it): the calls are enforced by structured outputs. "auto", OpenAI's default
    when tools are given, reads the calls the model writes with the server's tool-call parser
    (refused without one)."""
    parallel_tool_calls: bool | None = None
    """With tool_choice "required": false allows exactly one call."""

    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def to_sampling_params(
        self,
        max_tokens: int | None,
        defaults: dict[str, Any] | None = None,
        tool_call_parser: str | None = None,
    ) -> SamplingParams:
        from v1_engine.entrypoints.tool_calls import plan_tools

        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kwargs = self.base_sampling_kwargs(defaults)
        plan = plan_tools(self, tool_call_parser)
        if plan.structured is not None:
            if kwargs["structured_outputs"] is not None:
                raise ValueError(
                    "tool_choice conflicts: a forced tool call and another output constraint "
                    "(response_format, structured_outputs or guided_*) cannot both hold; set one"
                )
            kwargs["structured_outputs"] = plan.structured
        if plan.parser is not None:
            from v1_engine.entrypoints.tool_parsers import TOOL_PARSERS

            if TOOL_PARSERS[plan.parser].keeps_special_tokens:  # the calls' markers stay
                kwargs["skip_special_tokens"] = False
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    """With a reasoning parser: the completion's tokens that are reasoning."""


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    """With a reasoning parser: the thinking model's reasoning (its `<think>` block)."""
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "v1engine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)


class TokenizeResponse(ResponseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
