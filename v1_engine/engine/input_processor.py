"""InputProcessor: prompt → EngineCoreRequest, in the front-end process.

Tokenizes, applies the chat template, and validates everything a user can get wrong, so the
engine core only ever sees well-formed requests. Errors name the field and the allowed values.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from v1_engine.config import EngineConfig
from v1_engine.models.generation_config import load_generation_defaults
from v1_engine.protocol import EngineCoreRequest
from v1_engine.sampling_params import SamplingParams

PromptType = str | Sequence[int]
ChatMessages = list[dict[str, Any]]

RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "tokenize", "add_generation_prompt",
     "continue_final_message", "chat_template", "return_dict", "return_assistant_tokens_mask"}
)  # fmt: skip
"""Names chat_template_kwargs may not set: the request's own fields and the renderer's."""


def load_chat_template(value: str) -> str:
    """A chat template given as a file's path or as the Jinja text itself (as vLLM's
    --chat-template takes it), parsed; ValueError saying what is wrong with it."""
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return check_chat_template(f.read())
    if "{{" in value or "{%" in value:
        return check_chat_template(value)
    raise ValueError(f"{value!r} is neither a file nor a Jinja template")


def check_chat_template(text: str) -> str:
    """`text` if it parses as a Jinja template, else a ValueError saying where it does not."""
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"is not a valid Jinja template: {e.message} (line {e.lineno})") from None
    return text


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered (LLM.chat, AsyncEngine.chat and the chat API take them)."""

    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools, for templates that render them."""
    continue_final_message: bool = False
    """Leave the last (assistant) message open (needs add_generation_prompt False)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra template variables."""
    chat_template: str | None = None
    """A Jinja template replacing the model's for this conversation."""


CHAT_DEFAULTS = ChatOptions()


class NoChatTemplateError(ValueError):
    """The model has no chat template and none was given."""


class ChatFieldError(ValueError):
    """A chat option that cannot hold; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


def _check_tools(tools: list[dict[str, Any]] | None) -> None:
    """ValueError naming the first entry of `tools` that is not an OpenAI function tool."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {type(tools)}")  # noqa: TRY004
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise ValueError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                f'"parameters": {{...}}}}}}, got {tool!r}'
            )


def check_chat_options(
    messages: ChatMessages,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
) -> dict[str, Any]:
    """The extra keyword arguments for the chat template; ChatFieldError naming what does not
    fit. `continue_final_message` renders the last (assistant) message open, for the model to
    continue it, so it excludes a new turn's `add_generation_prompt`."""
    if continue_final_message:
        if add_generation_prompt:
            raise ChatFieldError(
                "continue_final_message",
                "cannot be combined with add_generation_prompt (which opens a new assistant "
                "turn): set add_generation_prompt to false",
            )
        if not messages or messages[-1].get("role") != "assistant":
            role = messages[-1].get("role") if messages else None
            raise ChatFieldError(
                "continue_final_message",
                f"needs an assistant message last to continue, got role {role!r}",
            )
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ChatFieldError(
            "chat_template_kwargs",
            f"may not set {reserved}: they are request fields or the renderer's own "
            f"({sorted(RESERVED_TEMPLATE_KWARGS)})",
        )
    return kwargs


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = config.model_config.max_model_len
        self.max_logprobs = config.model_config.max_logprobs
        mc = config.model_config
        self.generation = load_generation_defaults(mc.generation_config, str(mc.model))
        """The model's generation_config.json: EOS ids and default sampling."""
        self._extra_eos_ids = [i for i in self.generation.eos_token_ids if i != self.eos_token_id]
        """EOS ids besides the tokenizer's, stopped on as stop tokens (unless ignore_eos)."""

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended sampling (generation_config.json)."""
        return SamplingParams(**self.generation.sampling)

    def _with_model_eos(self, params: SamplingParams) -> SamplingParams:
        """`params` stopping on the model's other EOS ids too (unless ignore_eos)."""
        stops = params.stop_token_ids or []
        extra = [i for i in self._extra_eos_ids if i not in stops]
        if not extra or params.ignore_eos:
            return params
        return msgspec.structs.replace(params, stop_token_ids=[*stops, *extra])

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a non-empty str or a list of token ids (int)")

    def render_chat(self, messages: ChatMessages, options: ChatOptions = CHAT_DEFAULTS) -> str:
        """The conversation through the model's chat template (or `options.chat_template`),
        with `options.tools` (OpenAI's `{"type": "function", "function": {"name",
        "description", "parameters"}}` entries) for templates that render them and
        `options.chat_template_kwargs` (e.g. `{"enable_thinking": False}`) as template
        variables. ValueError naming what does not fit (ChatFieldError for an option,
        NoChatTemplateError without a template)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        _check_tools(options.tools)
        kwargs = check_chat_options(
            messages,
            options.add_generation_prompt,
            options.continue_final_message,
            options.chat_template_kwargs,
        )
        if options.chat_template is None and self.tokenizer.chat_template is None:
            raise NoChatTemplateError(
                "this model has no chat template: give one (chat_template) or send a plain prompt"
            )
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=options.chat_template,
                tools=options.tools,
                tokenize=False,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message,
                **kwargs,
            )
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"messages could not be rendered by the chat template: {e}") from None

    def chat_token_ids(
        self, messages: ChatMessages, options: ChatOptions = CHAT_DEFAULTS
    ) -> tuple[str, list[int]]:
        """The rendered conversation and its token ids."""
        text = self.render_chat(messages, options)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        self.validate(prompt_token_ids, params)
        self.check_priority(priority)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=self._with_model_eos(params),
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
        )

    def check_priority(self, priority: int) -> None:
        """A request's priority: an int, other than 0 only under the priority policy."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")  # noqa: TRY004
        policy = self.config.scheduler_config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(
                f"priority must be 0 under the {policy!r} scheduling policy, got {priority}; "
                "start the engine with scheduling_policy='priority' (--scheduling-policy "
                "priority) to order requests by it"
            )

    def process_fan_out(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        """One core request when n == 1; otherwise n children `{request_id}_{index}`.

        Everything is validated before anything is built, so a bad request adds nothing.
        """
        self.validate(prompt_token_ids, params)
        self.check_priority(priority)
        if params.n == 1:
            return [self.process(request_id, prompt_token_ids, params, arrival_time, priority)]
        arrival_time = time.time() if arrival_time is None else arrival_time
        return [
            self.process(
                f"{request_id}_{index}",
                prompt_token_ids,
                child_params(params, index),
                arrival_time,
                priority,
            )
            for index in range(params.n)
        ]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(  # noqa: TRY004 - a user input error, reported like the others
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        params.verify(self.max_logprobs)
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(prompt_token_ids)} tokens long; it must be shorter than "
                f"max_model_len ({self.max_model_len}) to leave room for output"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        for name, ids in params.token_id_fields().items():
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} must name token ids in [0, {self.vocab_size}), got {bad[:5]}"
                )


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Children of an n > 1 request sample independently; a seed stays reproducible per child."""
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)
