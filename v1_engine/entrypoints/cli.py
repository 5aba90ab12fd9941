"""v1serve: the command line. `v1serve [flags]` starts the OpenAI-compatible server;
`v1serve chat-demo [flags]` runs the terminal chat demo on the offline engine.

Flag names are vLLM's where vLLM has the flag, so existing launch scripts carry over.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from v1_engine.config import (
    ATTENTION_BACKEND_CHOICES,
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    LM_HEAD_QUANTIZATION_CHOICES,
    LOAD_FORMAT_CHOICES,
    LOG_FORMAT,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
)
from v1_engine.engine.input_processor import load_chat_template
from v1_engine.entrypoints.reasoning_parsers import REASONING_PARSERS
from v1_engine.entrypoints.tool_parsers import TOOL_PARSERS
from v1_engine.models.generation_config import generation_config_folder

API_KEY_ENV = "V1ENGINE_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

_EPILOG = """\
subcommands:
  v1serve chat-demo [--model PATH] [--prompt TEXT]...   chat with the model in the terminal

examples:
  v1serve                                   # default model on http://127.0.0.1:8000
  v1serve --model ./Llama-3.2-1B --port 9000 --api-key secret
  v1serve --host 0.0.0.0                    # listen on every interface (explicit choice)
"""


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="v1serve",
        description="Serve a model over an OpenAI-compatible HTTP API (v1engine).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_server_flags(parser)
    _add_engine_flags(parser)
    return parser


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1, loopback only; 0.0.0.0 exposes the server)",
    )
    group.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    group.add_argument(
        "--ssl-keyfile",
        default=None,
        help="TLS private key file: serve HTTPS (with --ssl-certfile)",
    )
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate file (PEM)")
    group.add_argument(
        "--allowed-origins",
        type=json_list,
        default=[],
        help="browser origins allowed cross-origin requests (CORS), a JSON list such as "
        "'[\"https://app.example.com\"]' or '[\"*\"]' (default: none)",
    )
    group.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request at INFO: its arrival (prompt tokens, sampling parameters) and its "
        "end (finish reason, output tokens, seconds)",
    )
    group.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy serves the API under, e.g. /llm (default: none)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set, "
        "else no key)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients send and see in /v1/models (default: the model file's name)",
    )
    group.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="logging level (default: info)"
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help='reads the tool calls of tool_choice "auto" (OpenAI\'s default with tools) in the '
        "model's format: hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1-3.3), pythonic "
        "(Llama 3.2 / 4), mistral, deepseek_v3; without "
        'it "auto" is a 400 ("required", "none" and named functions need no parser)',
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="the chat template for /v1/chat/completions and /tokenize instead of the model's: a "
        "file's path or the Jinja text itself",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template (Jinja text) in chat and /tokenize requests; off by "
        "default, as rendering runs the template's code in the server",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="splits a thinking model's reasoning (its <think> block) off into the chat "
        "message's reasoning_content: deepseek_r1 (DeepSeek-R1, QwQ, Qwen3 thinking-2507: the "
        "output is reasoning until </think>), qwen3 (Qwen3 hybrid: reasoning only when the output "
        "opens <think>)",
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic INFO line of engine statistics (throughput, queue, KV cache, prefix "
        "cache, speculative decoding)",
    )
    group.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between two lines of engine statistics (default: 10)",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: --tool-call-parser alone enables it",
    )


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or GGUF file (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer directory (default: the model's)",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=None,
        help="largest logprobs / top_logprobs / prompt_logprobs a request may ask for "
        "(default: 20)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length, prompt + output (default: the model's max_position_embeddings)",
    )
    group.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most requests running at once (default: 256)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step; longer prompts are chunked "
        "(default: max(2048, max-model-len) capped at 8192)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory for weights, activations and KV cache (default: 0.9)",
    )
    group.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV-cache block (default: 16; 64 for MLA models)",
    )
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV-cache blocks to allocate instead of sizing the pool from free memory "
        "(vLLM's --num-gpu-blocks-override)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="KV-cache dtype; auto follows the model dtype, fp8 (= fp8_e4m3) stores K/V in e4m3 "
        "with per-layer scales (default: auto)",
    )
    group.add_argument(
        "--attention-backend",
        default=None,
        choices=[c for c in ATTENTION_BACKEND_CHOICES if c is not None],
        help="attention backend; flash_attn needs the optional vllm_flash_attn package "
        "(default: triton on CUDA, cpu on CPU)",
    )
    group.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="weight/activation dtype; auto is float32 on CPU, bfloat16 on CUDA (default: auto)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of shared prompt prefixes (default: on)",
    )
    group.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N runs on the device (default: on with CUDA, off on "
        "CPU, where nothing can overlap)",
    )
    group.add_argument(
        "--scheduling-policy",
        default=None,
        choices=SCHEDULING_POLICIES,
        help="fcfs: requests run in arrival order; priority: by each request's priority field "
        "(lower first, ties by arrival), in admission and preemption (default: fcfs)",
    )
    group.add_argument(
        "-O",
        "--compilation-config",
        dest="compilation_config",
        type=compilation_value,
        default=None,
        help="compilation level (-O0 eager; -O1 torch.compile; -O2 also "
        "full CUDA graphs of decode steps) or a JSON object of CompilationConfig fields, e.g. "
        '\'{"level": 2, "cudagraph_capture_sizes": [1, 2, 4, 8]}\' (default: 2 on CUDA, 0 on '
        "CPU)",
    )
    group.add_argument(
        "--speculative-config",
        dest="speculative_config",
        type=json_object_value,
        default=None,
        help="speculative decoding as a JSON object of SpeculativeConfig fields, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt lookup: drafts copied from '
        "earlier in the request; greedy output is unchanged) (default: off)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model eagerly: no torch.compile, no CUDA graphs",
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of the engine's global RNG (default: 0)"
    )
    group.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMAT_CHOICES,
        help="auto (by path), dummy (random weights of the real config), gguf, safetensors",
    )
    group.add_argument(
        "--quantization",
        default=None,
        choices=[c for c in QUANTIZATION_CHOICES if c is not None],
        help="fp8: quantize the linear layers of a bf16/fp16/fp32 checkpoint to FP8 e4m3 at load "
        "(an FP8 checkpoint loads as FP8 without this flag) (default: none)",
    )
    group.add_argument(
        "--lm-head-quantization",
        default="auto",
        choices=LM_HEAD_QUANTIZATION_CHOICES,
        help="the LM head under FP8 linear layers: none (model dtype), fp8_rescored (FP8 scores, "
        "each strided 1024-token slice's top 4 recomputed in the model dtype), fp8 (all FP8, the "
        "high-precision weight dropped); auto: fp8_rescored on CUDA with FP8 layers, else none "
        "(default: auto)",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        help="auto: the model's generation_config.json sets the default sampling (temperature, "
        "top_p, top_k, min_p, repetition_penalty, max_new_tokens) of requests that leave it "
        "unset; vllm: the engine's defaults; or a folder holding a generation_config.json. The "
        "file's EOS ids are stopped on either way (default: auto)",
    )


def json_list(text: str) -> list[str]:
    """--allowed-origins: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def compilation_value(text: str) -> int | dict[str, Any]:
    """-O / --compilation-config: an int level, or a JSON object of CompilationConfig fields."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    return json_object_value(text, "an int level or a JSON object")


def json_object_value(text: str, expected: str = "a JSON object") -> dict[str, Any]:
    """A flag whose value is a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not {expected}: {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The AsyncEngine keyword arguments of the parsed flags; unset ones keep engine defaults."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager,
        "seed": args.seed,
        "load_format": args.load_format,
        "lm_head_quantization": args.lm_head_quantization,
        "generation_config": args.generation_config,
        "served_model_name": served_model_name(args),
    }
    optional = (
        "tokenizer",
        "max_logprobs",
        "block_size",
        "num_kv_blocks",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "async_scheduling",
        "scheduling_policy",
        "compilation_config",
        "speculative_config",
        "quantization",
        "attention_backend",
    )
    kwargs.update({k: getattr(args, k) for k in optional if getattr(args, k) is not None})
    return kwargs


def served_model_name(args: argparse.Namespace) -> str:
    """Known before the engine starts, so the metrics can carry it as a label."""
    if args.served_model_name:
        return args.served_model_name
    from v1_engine.engine.prepare import default_served_name

    return default_served_name(args.model)


def with_log_stats(args: argparse.Namespace, stat_loggers: list[Any]) -> list[Any]:
    """The server's stat loggers: `stat_loggers` plus the periodic log line unless
    --disable-log-stats."""
    if args.disable_log_stats:
        return list(stat_loggers)
    from v1_engine.metrics.loggers import LoggingStatLogger

    return [*stat_loggers, LoggingStatLogger(args.log_stats_interval)]


def run_server(args: argparse.Namespace) -> int:
    """Start the engine and the server; return the exit code (1 if the engine core died)."""
    import uvloop

    from v1_engine.entrypoints.api_server import serve

    kwargs = engine_kwargs(args)

    def make_engine(stat_loggers: list[Any]) -> Any:
        from v1_engine.engine.async_engine import AsyncEngine

        engine = AsyncEngine(stat_loggers=with_log_stats(args, stat_loggers), **kwargs)
        if args.chat_template is not None:  # checked in main(); the front-end renders chats
            engine.get_tokenizer().chat_template = load_chat_template(args.chat_template)
        return engine

    return uvloop.run(serve(make_engine, kwargs["served_model_name"], server_options(args)))


def server_options(args: argparse.Namespace) -> Any:
    """The ServerOptions of the parsed flags."""
    from v1_engine.entrypoints.serving_engine import ServerOptions

    return ServerOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_origins=args.allowed_origins,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
        log_requests=args.enable_log_requests,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if argv and argv[0] == "chat-demo":
        from v1_engine.entrypoints import demo

        demo.main(argv[1:])
        return
    if argv and argv[0] == "serve":
        argv = argv[1:]
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.chat_template is not None:
        try:
            load_chat_template(args.chat_template)
        except (OSError, ValueError) as e:
            parser.error(f"--chat-template {e}")
    try:
        generation_config_folder(args.generation_config, "")
    except ValueError as e:
        parser.error(f"--generation-config: {e}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    if args.log_stats_interval <= 0:
        parser.error(f"--log-stats-interval must be > 0, got {args.log_stats_interval}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(
            f"--enable-auto-tool-choice needs --tool-call-parser (one of {sorted(TOOL_PARSERS)})"
        )
    logging.getLogger().setLevel(args.log_level.upper())
    sys.exit(run_server(args))
