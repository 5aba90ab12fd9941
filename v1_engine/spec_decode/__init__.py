"""Speculative decoding: draft proposers and the acceptance of verified drafts."""
