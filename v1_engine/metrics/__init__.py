"""Stat loggers: what the engine reports after each batch of outputs."""
