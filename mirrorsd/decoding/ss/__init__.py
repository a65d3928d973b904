"""Speculative Streaming (Bhendawade et al. 2024, arXiv 2402.11131) as a method: one model verifies the last draft
tree and drafts the next in the same forward. :mod:`.method` holds ``ss`` on the loop (its tree guesses, pruning
choice and options), registered when the ``decoding`` package imports it. The streams themselves (adapters, the
fused pass, the graphed rollout) are shared with the drafts that self-verify, so they live in
:mod:`mirrorsd.decoding.streams`.
"""
