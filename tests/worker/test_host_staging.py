"""HostStaging packs a step's arrays into one buffer and returns views of one device copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from v1_engine.worker.host_staging import HostStaging


class _Event:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 50_000, size=7, dtype=np.int64),
        "query_start_loc": np.arange(4, dtype=np.int32) * 3,  # 16 bytes
        "seq_lens": rng.integers(1, 100, size=3, dtype=np.int32),  # 12 bytes: padded
        "block_table": rng.integers(0, 999, size=(3, 5), dtype=np.int32),
        "feed_dst": np.zeros(0, dtype=np.int64),  # empty
        "logits_idx": rng.integers(0, 7, size=3, dtype=np.int64),
    }


def check(staging: HostStaging, seed: int) -> dict[str, torch.Tensor]:
    want = arrays(seed)
    got = staging.stage(**want)
    assert list(got) == list(want)
    for name, array in want.items():
        tensor = got[name]
        assert tensor.device.type == staging.device.type
        assert tensor.dtype == torch.from_numpy(array).dtype and tuple(tensor.shape) == array.shape
        assert tensor.data_ptr() % 8 == 0
        np.testing.assert_array_equal(tensor.cpu().numpy(), array)
    return got


def test_packed_staging_round_trips_every_array(monkeypatch):
    """The pinned path's packing, run on the CPU (pinning and events stubbed out)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    staging = HostStaging(torch.device("cpu"))
    staging.pinned = True
    first = check(staging, 0)
    second = check(staging, 1)  # the other pinned buffer: the first step's arrays stay intact
    for name, array in arrays(0).items():
        np.testing.assert_array_equal(first[name].numpy(), array)
    assert first["input_ids"].data_ptr() != second["input_ids"].data_ptr()
    check(staging, 2)  # back to the first buffer


@pytest.mark.gpu
def test_packed_staging_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    staging = HostStaging(torch.device("cuda"))
    results = [check(staging, seed) for seed in range(4)]
    torch.cuda.synchronize()
    for seed, got in enumerate(results):
        for name, array in arrays(seed).items():
            np.testing.assert_array_equal(got[name].cpu().numpy(), array)
