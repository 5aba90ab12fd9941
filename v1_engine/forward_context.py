"""The per-step forward context: what the opaque attention op reads while the model runs.

The model's forward signature stays `(input_ids, positions)` so torch.compile sees a small pure
function; everything step-specific (attention metadata, the backend, the layers by name) travels
here instead. A context manager that refuses nesting keeps the state scoped to one forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from v1_engine.attention.backend import AttentionBackend, AttentionMetadata
    from v1_engine.layers.attention import Attention


@dataclass(frozen=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    """Metadata of this step; None for a run without a KV cache (e.g. memory profiling)."""
    attn_backend: AttentionBackend
    """The backend the attention op calls."""
    attention_layers: dict[str, Attention]
    """The model's attention layers by `layer_name`; the op finds its layer's KV cache here."""


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None,
    attn_backend: AttentionBackend,
    attention_layers: Iterable[Attention],
) -> Iterator[ForwardContext]:
    """Make the step's metadata visible to the attention op for the duration of one forward.

    `attention_layers` is the model's `attention_layers()`: the op finds each layer (and the KV
    cache bound to it) by name here, so two models in one process never see each other's."""
    global _current
    if _current is not None:
        raise RuntimeError("set_forward_context cannot be nested: a forward context is active")
    layers = {layer.layer_name: layer for layer in attention_layers}
    _current = ForwardContext(attn_metadata, attn_backend, layers)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    """The active context; attention outside `set_forward_context` is a bug in the caller."""
    if _current is None:
        raise RuntimeError(
            "no forward context is active; wrap the model call in set_forward_context"
        )
    return _current


def has_forward_context() -> bool:
    return _current is not None
