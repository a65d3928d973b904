"""The Speculative Streaming machinery every method that drafts with streams shares (``ss``; ``sd`` and Mirror-SD
with ``draft_streams``), one module per part: :mod:`.adapters` (the streams' trainable pieces over our model: stream
embeddings, LoRA on stream rows, the pruning adapter, and where they ship); :mod:`.passes` (one fused pass: tree,
pruning, streams, verification, compaction; used by ``ss`` and by
:class:`~mirrorsd.decoding.proposers.StreamProposer`, a draft that self-verifies); :mod:`.rollout_graph` (a stream
rollout as one captured graph). No method lives here: importing it registers nothing.
"""
