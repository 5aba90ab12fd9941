"""Request parsing, error mapping, CLI flags and the Prometheus logger, without an engine."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from v1_engine.entrypoints.api_server import startup_banner
from v1_engine.entrypoints.cli import engine_kwargs, main, make_parser, server_options
from v1_engine.entrypoints.errors import error_body, from_value_error, validation_error
from v1_engine.entrypoints.protocol_openai import ChatCompletionRequest, CompletionRequest
from v1_engine.metrics.prometheus import PrometheusStatLogger
from v1_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from v1_engine.protocol import SchedulerStats


def test_completion_request_to_sampling_params():
    request = CompletionRequest(
        prompt="hi",
        max_tokens=9,
        temperature=0.5,
        top_k=5,
        stop="END",
        seed=3,
        logprobs=2,
        echo=True,
        ignore_eos=True,
        min_tokens=2,
    )
    params = request.to_sampling_params(9)
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (9, 0.5, 5, 3)
    assert params.stop == ["END"] and params.ignore_eos and params.min_tokens == 2
    assert params.logprobs == 2 and params.prompt_logprobs == 2  # echo + logprobs
    assert params.top_p == 1.0  # unset fields keep SamplingParams' defaults


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_chat_request_logprobs_and_max_tokens():
    request = ChatCompletionRequest(
        messages=[{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}],
        max_tokens=10,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
    )
    assert request.requested_max_tokens() == 4
    assert request.messages[0].flat() == {"role": "system", "content": "be brief"}
    assert request.to_sampling_params(4).logprobs == 3
    no_lp = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert no_lp.to_sampling_params(None).logprobs is None


def _validation_error(model, data) -> RequestValidationError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return RequestValidationError(errors)


def test_validation_errors_name_the_field():
    err = validation_error(_validation_error(CompletionRequest, {"prompt": "x", "n": 0}))
    assert err.status == HTTPStatus.BAD_REQUEST and err.param == "n"
    assert err.message.startswith("n: ")
    unknown = validation_error(_validation_error(CompletionRequest, {"prompt": "x", "foo": 1}))
    assert unknown.param == "foo" and "unknown field" in unknown.message
    union = validation_error(_validation_error(CompletionRequest, {"prompt": 5}))
    assert union.param == "prompt"


def test_value_error_param_and_body_shape():
    err = from_value_error(ValueError("top_p must be in (0, 1], got 2"), {"top_p"})
    assert err.param == "top_p"
    assert from_value_error(ValueError("something odd"), {"top_p"}).param is None
    body = error_body("nope", HTTPStatus.UNAUTHORIZED, code="invalid_api_key")
    assert body == {
        "error": {
            "message": "nope",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert error_body("x", HTTPStatus.SERVICE_UNAVAILABLE)["error"]["type"] == "server_error"


def test_cli_defaults_and_flags():
    args = make_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.enable_prefix_caching
    kwargs = engine_kwargs(args)
    assert kwargs["served_model_name"] == "SmolLM2-135M-Instruct"
    assert "max_model_len" not in kwargs  # unset flags keep the engine's defaults
    args = make_parser().parse_args(
        [
            "--max-model-len",
            "512",
            "--no-enable-prefix-caching",
            "--served-model-name",
            "m",
            "--load-format",
            "dummy",
            "--enforce-eager",
            "--max-num-seqs",
            "4",
            "--tokenizer",
            "/tok",
            "--max-logprobs",
            "5",
            "--generation-config",
            "vllm",
        ]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["max_model_len"] == 512 and kwargs["max_num_seqs"] == 4
    assert kwargs["tokenizer"] == "/tok" and kwargs["max_logprobs"] == 5
    assert kwargs["generation_config"] == "vllm"
    assert kwargs["enable_prefix_caching"] is False and kwargs["enforce_eager"] is True
    assert kwargs["served_model_name"] == "m" and kwargs["load_format"] == "dummy"


def test_cli_compilation_config():
    assert "compilation_config" not in engine_kwargs(make_parser().parse_args([]))
    assert engine_kwargs(make_parser().parse_args(["-O1"]))["compilation_config"] == 1
    args = make_parser().parse_args(["--compilation-config", '{"level": 1}'])
    assert engine_kwargs(args)["compilation_config"] == {"level": 1}
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--compilation-config", "fast"])


def test_cli_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in (
        "--model",
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--gpu-memory-utilization",
        "--kv-cache-dtype",
        "--dtype",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--seed",
        "--load-format",
        "--log-level",
        "chat-demo",
    ):
        assert flag in text


def test_startup_banner_has_pasteable_curl():
    url_line, curl_line = startup_banner("0.0.0.0", 8123, "m", "k")
    assert "http://127.0.0.1:8123" in url_line
    assert curl_line.startswith("try: curl http://127.0.0.1:8123/v1/chat/completions")
    assert "'Authorization: Bearer k'" in curl_line and '"model": "m"' in curl_line
    url_line, curl_line = startup_banner("0.0.0.0", 8123, "m", None, "https", "/llm/")
    assert "https://127.0.0.1:8123/llm " in url_line
    assert curl_line.startswith("try: curl https://127.0.0.1:8123/llm/v1/chat/completions")


def test_server_flags_reach_the_server_options(monkeypatch):
    monkeypatch.delenv("V1ENGINE_API_KEY", raising=False)
    defaults = server_options(make_parser().parse_args([]))
    assert defaults.allowed_origins == [] and defaults.scheme == "http" and not defaults.api_key
    flags = ["--allowed-origins", '["https://a.example", "*"]', "--root-path", "/llm",
             "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--reasoning-parser", "qwen3",
             "--trust-request-chat-template", "--block-size", "32", "--num-kv-blocks", "100"]  # fmt: skip
    args = make_parser().parse_args(flags)
    options = server_options(args)
    assert options.allowed_origins == ["https://a.example", "*"] and options.root_path == "/llm"
    assert options.scheme == "https" and options.ssl_keyfile == "k.pem"
    assert options.reasoning_parser == "qwen3" and options.trust_request_chat_template
    assert engine_kwargs(args)["block_size"] == 32 and engine_kwargs(args)["num_kv_blocks"] == 100
    monkeypatch.setenv("V1ENGINE_API_KEY", "from-env")
    assert server_options(make_parser().parse_args([])).api_key == "from-env"
    for bad in (["--allowed-origins", "https://a.example"], ["--allowed-origins", "[1]"]):
        with pytest.raises(SystemExit):
            make_parser().parse_args(bad)
    with pytest.raises(SystemExit):
        main(["--ssl-keyfile", "k.pem"])  # without the certificate


def _output(request_id, token_ids, finish=None, metrics=None, prompt_len=5, index=0):
    completion = CompletionOutput(index, "t", token_ids, None, None, finish_reason=finish)
    return RequestOutput(
        request_id,
        None,
        list(range(prompt_len)),
        None,
        [completion],
        finished=finish is not None,
        metrics=metrics,
    )


def _value(logger: PrometheusStatLogger, name: str, **labels) -> float:
    labels = {"model_name": "m", **labels}
    return logger.registry.get_sample_value(f"v1engine:{name}", labels)


def test_prometheus_logger_counts_and_latencies():
    logger = PrometheusStatLogger("m")
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0)
    logger.record(
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=1,
            kv_cache_usage=0.25,
            prefix_cache_queries=32,
            prefix_cache_hits=16,
        ),
        [_output("a", [1], metrics=metrics)],
        101.0,
    )
    logger.record(None, [_output("a", [2, 3], metrics=metrics)], 101.5)
    metrics.finished_time = 102.0
    logger.record(None, [_output("a", [4], finish="length", metrics=metrics)], 102.0)
    assert _value(logger, "num_requests_running") == 2
    assert _value(logger, "num_requests_waiting") == 1
    assert _value(logger, "kv_cache_usage_perc") == 0.25
    assert _value(logger, "prefix_cache_queries_total") == 32
    assert _value(logger, "prefix_cache_hits_total") == 16
    assert _value(logger, "prompt_tokens_total") == 5  # counted once per request
    assert _value(logger, "generation_tokens_total") == 4
    assert _value(logger, "request_success_total", finished_reason="length") == 1
    assert _value(logger, "time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert _value(logger, "inter_token_latency_seconds_count") == 2
    assert _value(logger, "inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert _value(logger, "e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert _value(logger, "request_queue_time_seconds_sum") == pytest.approx(0.5)
    text = logger.render().decode()
    assert 'v1engine:request_success_total{finished_reason="length",model_name="m"} 1.0' in text


def test_prometheus_loggers_have_separate_registries():
    first, second = PrometheusStatLogger("m"), PrometheusStatLogger("m")
    first.record(None, [_output("a", [1, 2])], 1.0)
    assert _value(first, "generation_tokens_total") == 2
    assert _value(second, "generation_tokens_total") == 0


def test_cli_kv_cache_dtype_fp8_reaches_the_engine(capsys):
    args = make_parser().parse_args(["--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--kv-cache-dtype", "int4"])
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp8_e4m3" in err
