"""Per-device semaphores of the kernels that finish their work in the program that arrives last
(the split-K skinny GEMMs, the split-KV merges of paged attention and MLA decode).

A program counts itself in on its tile's semaphore with an acq_rel atomic; the last to arrive
finishes the tile and resets the semaphore to zero, so the buffer is all zeros between launches
and every such kernel on a device shares it. Launches must therefore not run concurrently on two
streams (the engine runs its forward on one).
"""

from __future__ import annotations

import torch

_SEMAPHORES: dict[torch.device, torch.Tensor] = {}
"""Per device: the zeroed semaphore buffer."""
_OUTGROWN: list[torch.Tensor] = []
"""Buffers replaced by a larger one, never freed: CUDA graphs may have captured them."""


def split_semaphores(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 semaphores on `device`, allocated (or grown) outside CUDA
    graph capture: a capture may only reuse them (the engine's warm-up runs every shape eagerly
    first)."""
    semaphores = _SEMAPHORES.get(device)
    if semaphores is None or semaphores.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a kernel with split work was first launched during CUDA graph capture: run "
                "the shape once eagerly first, so its semaphores exist outside the graph"
            )
        if semaphores is not None:  # graphs captured on it still point there: keep it alive
            _OUTGROWN.append(semaphores)
        semaphores = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _SEMAPHORES[device] = semaphores
    return semaphores
