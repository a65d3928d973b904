"""Speculative Streaming (Bhendawade et al. 2024, arXiv 2402.11131): one model verifies the last draft tree and
drafts the next in the same forward, through multi-stream attention in its top ``N_s`` layers.

The package, one module per part: :mod:`.adapters` (the streams' trainable pieces over our model: stream
embeddings, LoRA on stream rows, the pruning adapter, and where they ship); :mod:`.passes` (one fused pass: tree,
pruning, streams, verification, compaction; shared with a draft that self-verifies,
:class:`~mirrorsd.decoding.proposers.StreamProposer`); :mod:`.method` (``ss`` on the loop, registered when the
``decoding`` package imports it: importing this package alone registers nothing, so the shared proposers can use
the passes without changing the methods' listing order).
"""
