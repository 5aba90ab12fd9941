"""The speculative-decoding counters of the scheduler's stats, summed over a test's steps."""

from __future__ import annotations

from v1_engine import LLM


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
