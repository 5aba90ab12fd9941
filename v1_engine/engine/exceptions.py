"""Errors the front-end raises about the engine core as a whole (not about one request)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed or shut down); nothing more will run.

    Every pending and every later request of the engine raises this; the engine must be
    recreated.
    """


class EngineStartupError(RuntimeError):
    """The engine-core process failed to start (bad model, out of memory, timeout, ...)."""
