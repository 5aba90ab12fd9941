"""Which CUDA graphs a runner plans, worked out from the config alone (on the CPU: the plan is
told its device is CUDA and given a stand-in model and backend; nothing is captured)."""

from __future__ import annotations

import types

import pytest
import torch

from v1_engine.config import EngineConfig
from v1_engine.layers.mla import MLAAttention
from v1_engine.worker.cuda_graph_plan import CudaGraphPlan

CUDA = torch.device("cuda")


class _Model:
    def __init__(self, layers):
        self._layers = layers

    def attention_layers(self):
        return self._layers


def _plan(layers=(), device=CUDA, varlen=True, **kwargs):
    config = EngineConfig.from_kwargs(max_num_seqs=32, max_num_batched_tokens=64, **kwargs)
    backend = types.SimpleNamespace(supports_cudagraph=True, supports_varlen_cudagraph=varlen)
    return CudaGraphPlan(config, _Model(list(layers)), backend, device, torch.bfloat16, 64, 100)


def test_level_2_plans_decode_and_piecewise_graphs():
    plan = _plan(compilation_config={"level": 2, "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})
    assert plan.possible and plan.decode_sizes == [1, 2, 4, 8, 16, 32]
    assert plan.piecewise_sizes == [1, 2, 4, 8, 16, 32] and plan.verify_sizes == []
    assert plan.sizes == [1, 2, 4, 8, 16, 32]


def test_verify_graphs_fit_the_token_budget():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    sizes = {"level": 2, "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    plan = _plan(compilation_config=sizes, speculative_config=spec)
    assert plan.verify_query_len == 4
    assert plan.verify_sizes == [1, 2, 4, 8, 16]  # 32 requests x 4 tokens > the 64-token budget
    assert plan.sizes == [1, 2, 4, 8, 16, 32, 64]  # 16 x 4 = 64 tokens for the verify graph
    off = _plan(compilation_config={**sizes, "verify_cudagraphs": False}, speculative_config=spec)
    assert off.verify_sizes == [] and off.decode_sizes == sizes["cudagraph_capture_sizes"]
    assert _plan(compilation_config=sizes, speculative_config=spec, varlen=False).verify_sizes == []
    mla = object.__new__(MLAAttention)  # only its type is looked at
    with_mla = _plan([mla], compilation_config=sizes, speculative_config=spec)
    assert with_mla.decode_sizes and with_mla.verify_sizes == []  # MLA verify steps: piecewise


@pytest.mark.parametrize(
    ("kwargs", "device"),
    [
        ({"compilation_config": 2}, torch.device("cpu")),  # graphs need CUDA
        ({"compilation_config": 0}, CUDA),
        ({"enforce_eager": True}, CUDA),
    ],
)
def test_no_graphs_without_cuda_or_compilation(kwargs, device):
    plan = _plan(device=device, **kwargs)
    assert not plan.possible and plan.sizes == [] and plan.reserve_bytes() == 0
    assert plan.capture(lambda ids, pos: ids) is False


def test_level_1_plans_piecewise_graphs_only():
    plan = _plan(compilation_config={"level": 1, "cudagraph_capture_sizes": [1, 8, 64]})
    assert plan.decode_sizes == [] and plan.piecewise_sizes == [1, 8, 64]
