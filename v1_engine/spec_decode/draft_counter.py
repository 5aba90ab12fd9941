"""DraftCounter: the speculative-decoding counters of an offline engine's scheduler stats, summed
over its steps from a point on (the tests' and the spec benchmark's measure of drafts kept)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from v1_engine.engine.llm import LLM


class DraftCounter:
    """Totals of the scheduler's spec_* stats (per-step counts) from now on."""

    def __init__(self, llm: LLM) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0
        scheduler = llm.engine_core.scheduler
        original = scheduler.make_stats

        def counting():
            stats = original()
            self.drafts += stats.spec_num_drafts
            self.draft_tokens += stats.spec_num_draft_tokens
            self.accepted += stats.spec_num_accepted_tokens
            return stats

        scheduler.make_stats = counting
