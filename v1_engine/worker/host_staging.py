"""Host-to-device staging of a step's inputs through pinned, double-buffered memory."""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16
"""Byte alignment of each array inside the packed buffer (any dtype can view it)."""


class HostStaging:
    """Host-to-device copies of a step's inputs through pinned memory, without a sync.

    All of a step's arrays are packed into one pinned byte buffer and cross in ONE
    non-blocking copy (each copy is a graph-external launch that costs the device ~2-3 us, and a
    step has about ten arrays); the device tensors returned are views of that one buffer. Two
    pinned buffers alternate, each with an event recorded after its copy: the one a step writes
    was last used two steps ago, so waiting on its event costs nothing in practice and
    guarantees the host never overwrites memory a copy is still reading.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def stage(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        hosts = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        if not self.pinned:
            return hosts
        turn, self._turn = self._turn, self._turn ^ 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        offsets, total = {}, 0
        for name, host in hosts.items():
            offsets[name] = total
            total += -(-host.numel() * host.element_size() // _ALIGN) * _ALIGN
        buffer = self._buffers[turn]
        if buffer is None or buffer.numel() < total:
            buffer = torch.empty(max(2 * total, 4096), dtype=torch.uint8).pin_memory()
            self._buffers[turn] = buffer
        for name, host in hosts.items():
            nbytes = host.numel() * host.element_size()
            start = offsets[name]
            buffer[start : start + nbytes].view(host.dtype).copy_(host.reshape(-1))
        on_device = buffer[: max(total, _ALIGN)].to(self.device, non_blocking=True)
        self._copied[turn] = torch.cuda.Event()
        self._copied[turn].record()
        staged = {}
        for name, host in hosts.items():
            start = offsets[name]
            nbytes = host.numel() * host.element_size()
            staged[name] = on_device[start : start + nbytes].view(host.dtype).view(host.shape)
        return staged
