"""Structured outputs: output constrained to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar, through xgrammar.

- `StructuredOutputsParams` (a field of SamplingParams) says which; `verify()` parses the spec
  in the front-end, so a bad schema or regex is a ValueError naming its field before the
  request reaches the engine core.
- In the engine core, `GrammarCompilerService` compiles the spec against the model's
  vocabulary on a worker thread (cached by spec) from the request's arrival; the scheduler
  admits the request once its grammar is compiled and schedules the others meanwhile, so a
  slow grammar holds back only its own request. `RequestGrammar` holds one request's matcher.
- Each step the model runner asks every constrained row for its allowed tokens
  (`RequestGrammar.fill_bitmask`, after the row's newest tokens are on the host) and the sampler
  masks the rest (`apply_token_bitmask`), greedy rows included. Stop tokens are allowed only
  where the grammar may end, so a constrained output ends complete unless max_tokens cuts it.

JSON schemas compile without free whitespace between tokens (compact JSON): with it a small
model can fill its whole budget with spaces and newlines.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BITS = 32
"""Tokens per word of xgrammar's bitmask (int32 words, bit i of word w = token 32 w + i)."""

MAX_CACHED_GRAMMARS = 256
"""Compiled grammars kept for reuse (least recently used dropped first); a server that sees a
new schema with every request would otherwise grow without bound."""


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Exactly one of the fields below constrains the output (vLLM's `structured_outputs`)."""

    json: str | None = None
    """A JSON schema (as JSON text; a dict or `True` is serialized) the output must satisfy."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format {"type": "json_object"}; not an array or a
    scalar)."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's dialect, GBNF-like) whose `root` rule the output matches."""
    reasoning_end: list[int] | None = None
    """The token ids that end a thinking model's reasoning (`</think>`): the output is free
    until they occur in it, and the constraint holds for what follows (set by the server's
    reasoning parser, not by clients; not part of the compiled grammar)."""
    reasoning_start: int | None = None
    """With `reasoning_end`: the token that opens the reasoning (`<think>`) where the model may
    or may not think (Qwen3 hybrids). The first output token may be it or one the constraint
    allows: it opens the reasoning (free until `reasoning_end`), any other starts the
    constrained output. None: the output is reasoning from its first token."""

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            self.json = json.dumps(self.json)  # a schema given as a dict (or `true`)

    def spec(self) -> tuple[str, str]:
        """(kind, text): the one constraint set, as the compiler takes it. ValueError naming
        the field unless exactly one is set."""
        given = {
            name: value
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        }
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice "
                f"or grammar, got {sorted(given) or 'none'}"
            )
        ((kind, value),) = given.items()
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {value!r}"
                )
            # Each choice a JSON-escaped EBNF literal; xgrammar reads the same escapes.
            return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in value)
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        return kind, value

    def verify(self) -> None:
        """Parse the constraint (no vocabulary needed): ValueError naming the field if it is
        not a valid JSON schema / regex / grammar. Parses are cached by spec, so the server's
        conversion, the engine's check and every child of an n > 1 request parse once."""
        kind, text = self.spec()
        problem = _parse_problem(kind, text)
        if problem is not None:
            field = "choice" if self.choice is not None else kind
            raise ValueError(f"structured_outputs.{field} {problem}")


@functools.lru_cache(maxsize=256)
def _parse_problem(kind: str, text: str) -> str | None:
    """Why `text` is not a valid `kind` spec (the rest of the error message), or None."""
    if kind == "json":
        try:
            json.loads(text)
        except ValueError as e:
            return f"is not valid JSON: {e}"
    xgr = _xgrammar()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "a JSON schema it supports", "regex": "a regular expression"}.get(
            kind, "a grammar"
        )
        return f"is not {what}: {_first_line(e)}"
    return None


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    # xgrammar prefixes its messages with "[time] file:line: ".
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ValueError("structured outputs need the xgrammar package") from e
    return xgrammar


class GrammarCompilerService:
    """Compiles specs against the model's vocabulary on one worker thread, each spec once.

    The tokenizer is loaded at the first constrained request, so engines that never see one pay
    nothing."""

    def __init__(self, tokenizer_path: Path | str, vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`, as a future (shared by equal specs)."""
        key = params.spec()
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._pool.submit(self._compile, *key)
                self._futures[key] = future
                if len(self._futures) > MAX_CACHED_GRAMMARS:
                    self._futures.popitem(last=False)
            self._futures.move_to_end(key)
        return future

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self._get_compiler()
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            # An object with any members (xgrammar's builtin JSON grammar takes any value).
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            from v1_engine.models.loader import get_tokenizer

            xgr = _xgrammar()
            tokenizer = get_tokenizer(Path(self.tokenizer_path))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


class RequestGrammar:
    """One request's grammar state: its matcher has accepted the first `num_accepted` tokens of
    the constrained output (the whole output, or with `reasoning_end` what follows those
    tokens' first occurrence; until then every token is allowed)."""

    def __init__(
        self,
        compiled: Future,
        eos_token_id: int | None,
        reasoning_end: list[int] | None = None,
        reasoning_start: int | None = None,
    ) -> None:
        self._compiled = compiled
        self._eos_token_id = eos_token_id
        self._matcher: Any = None
        self._failed = False
        self.num_accepted = 0
        self._reasoning_end = list(reasoning_end or [])
        self.start: int | None = None if self._reasoning_end else 0
        """Where the constrained output starts (None while the reasoning goes on)."""
        self._searched = 0
        """Outputs searched for the end of the reasoning so far."""
        self._opening = reasoning_start if self._reasoning_end else None
        """The token that, as the first output, opens the reasoning (None: it is open)."""

    def _end_of_reasoning(self, tokens: list[int], searched: int) -> int | None:
        """The index after the first occurrence of the reasoning's end in `tokens`, searching
        from where an occurrence could end past `searched`; None without one."""
        end, n = self._reasoning_end, len(self._reasoning_end)
        for i in range(max(0, searched - n + 1), len(tokens) - n + 1):
            if tokens[i : i + n] == end:
                return i + n
        return None

    def _reasoning(self, output_token_ids: list[int]) -> bool:
        """Whether the output is still free (the reasoning has not ended in it; with an opening
        token, an empty output is free too: `fill_bitmask` gives its row)."""
        if self.start is None and self._opening is not None and output_token_ids:
            if output_token_ids[0] != self._opening:
                self.start = 0  # the model did not think: constrained from its first token
            self._opening = None
        if self.start is None:
            self.start = self._end_of_reasoning(output_token_ids, self._searched)
            self._searched = len(output_token_ids)
        return self.start is None

    def fill_bitmask(self, output_token_ids: list[int], bitmask: torch.Tensor, row: int) -> None:
        """Accept the outputs not yet accepted, then write the allowed next tokens into
        bitmask[row] (int32 words, BITS tokens each; a row left as it is allows every token, as
        during the reasoning). Waits for the compile the first time.
        A grammar that failed to compile (the front-end parsed it, so this is not expected)
        allows only EOS: the request ends at once, and the engine keeps serving. So does a
        matcher that has accepted its stop token (a step async scheduling planned early)."""
        if self._may_open(output_token_ids):
            self._first_mask(bitmask, row)
            bitmask[row, self._opening // BITS] |= _word_bit(self._opening % BITS)  # type: ignore[operator]
            return
        if self._reasoning(output_token_ids):
            return
        if not self._catch_up(output_token_ids):
            self._only_eos(bitmask, row)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_bitmasks(
        self, output_token_ids: list[int], drafts: list[int], bitmask: torch.Tensor, row: int
    ) -> None:
        """A verify step's rows row .. row + len(drafts): the allowed tokens after the outputs,
        then after each draft in turn. The drafts are accepted only for this and rolled back.
        After a draft the grammar refuses, the rows are left as they are: the row before it
        cannot sample that draft, so the verify never reads them. While the reasoning goes on
        the rows allow every token, up to the draft that ends it (valid_prefix cut the drafts
        after that one), whose next row is the grammar's first."""
        if self._may_open(output_token_ids):  # a first token is not drafted: only its row
            self.fill_bitmask(output_token_ids, bitmask, row)
            return
        if self._reasoning(output_token_ids):
            end = self._end_of_reasoning(output_token_ids + drafts, len(output_token_ids))
            if end is not None:
                self._first_mask(bitmask, row + end - len(output_token_ids))
            return
        self.fill_bitmask(output_token_ids, bitmask, row)
        if not drafts or self._matcher is None or self._matcher.is_terminated():
            return
        num_accepted = 0
        for i, draft in enumerate(drafts):
            if not self._matcher.accept_token(draft):
                break
            num_accepted += 1
            if self._matcher.is_terminated():
                self._only_eos(bitmask, row + i + 1)
                break
            self._matcher.fill_next_token_bitmask(bitmask, row + i + 1)
        if num_accepted:
            self._matcher.rollback(num_accepted)

    def valid_prefix(self, output_token_ids: list[int], drafts: list[int]) -> list[int]:
        """The drafts the grammar allows after the outputs, up to the first one it refuses
        (speculative decoding does not verify what could never be kept). During the reasoning,
        the drafts up to the one that ends it."""
        if self._may_open(output_token_ids):
            return []
        if self._reasoning(output_token_ids):
            end = self._end_of_reasoning(output_token_ids + drafts, len(output_token_ids))
            return drafts if end is None else drafts[: end - len(output_token_ids)]
        if not drafts or not self._catch_up(output_token_ids):
            return []
        num_accepted = 0
        for draft in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(draft):
                break
            num_accepted += 1
        if num_accepted:
            self._matcher.rollback(num_accepted)
        return drafts[:num_accepted]

    def _may_open(self, output_token_ids: list[int]) -> bool:
        """Whether the next token is the first and may open the reasoning."""
        return self._opening is not None and self.start is None and not output_token_ids

    def _first_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row`: the grammar's allowed first tokens (its matcher has accepted nothing)."""
        if self._make_matcher() and self.num_accepted == 0:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _make_matcher(self) -> bool:
        """Make the matcher once the compile is done; False when the compile failed."""
        if self._matcher is None and not self._failed:
            try:
                self._matcher = _xgrammar().GrammarMatcher(self._compiled.result())
            except Exception:
                logger.exception("structured output: the grammar failed to compile")
                self._failed = True
        return not self._failed

    def _catch_up(self, output_token_ids: list[int]) -> bool:
        """Make the matcher and accept the constrained outputs (from `start` on) it has not
        seen; False when there is no mask to give (the compile failed, or the matcher has
        accepted its stop token)."""
        if not self._make_matcher():
            return False
        assert self.start is not None
        for token_id in output_token_ids[self.start + self.num_accepted :]:
            if self._matcher.is_terminated():
                break
            if not self._matcher.accept_token(token_id):
                logger.warning("token %d does not match the request's grammar", token_id)
            self.num_accepted += 1
        # A terminated matcher: the stop token was accepted, yet the request is sampled again
        # (async scheduling planned this step before the scheduler saw that token). The
        # scheduler drops what this step samples; a matcher past its end has no mask to give.
        return not self._matcher.is_terminated()

    def _only_eos(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` allows only EOS (every token where the request has no EOS id)."""
        if self._eos_token_id is not None:
            bitmask[row] = 0
            bitmask[row, self._eos_token_id // BITS] = _word_bit(self._eos_token_id % BITS)


def _word_bit(bit: int) -> int:
    """The int32 word with only `bit` set (bit 31 is the sign bit)."""
    return (1 << bit) - (1 << 32) * (bit == BITS - 1)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / BITS)] int32, every token allowed (all bits set)."""
    import torch

    return torch.full((rows, -(-vocab_size // BITS)), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf (in place) on every token whose bit is clear in its row of `bitmask`
    ([N, ceil(V / BITS)] int32, on logits' device); [N, V] float32 logits. xgrammar's kernel:
    native on the CPU, Triton on CUDA (5x and more faster on the CPU than unpacking the bits
    with torch ops, which the tests keep as the oracle)."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask)
    return logits
