"""A terminal chat with the default model, streamed token by token through the offline engine."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from v1_engine.engine.llm import LLM
from v1_engine.engine.output_processor import OutputKind
from v1_engine.sampling_params import SamplingParams


def stream_chat(llm: LLM, messages: list[dict], params: SamplingParams) -> Iterator[str]:
    """Yield text deltas of one chat reply as the engine produces them."""
    prompt, token_ids = llm.input_processor.chat_token_ids(messages)
    request = llm.input_processor.process("demo", token_ids, params)
    llm.output_processor.add_request(request, prompt, OutputKind.DELTA)
    llm.engine_core.add_request(request)
    while llm.engine_core.has_unfinished_requests():
        processed = llm.output_processor.process_outputs(llm.engine_core.step())
        if processed.reqs_to_abort:
            llm.engine_core.abort_requests(processed.reqs_to_abort)
        for output in processed.request_outputs:
            yield output.outputs[0].text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Chat with a model in the terminal.")
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default model)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--prompt", action="append", help="user turns to answer (non-interactive when given)"
    )
    args = parser.parse_args(argv)
    llm = LLM(model=args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    turns = iter(args.prompt) if args.prompt else _read_turns()
    messages: list[dict] = []
    for user_text in turns:
        if args.prompt:
            print(f"you> {user_text}")
        messages.append({"role": "user", "content": user_text})
        print("assistant> ", end="", flush=True)
        reply = []
        for delta in stream_chat(llm, messages, params):
            reply.append(delta)
            print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _read_turns() -> Iterator[str]:
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            return
        if not text:
            return
        yield text


if __name__ == "__main__":
    main()
