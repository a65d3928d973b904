"""Benchmarks: ``forward`` (k-token forward costs), ``runner`` (the Spec-Bench runner with peers in the same run),
``metrics`` (Spec-Bench's speedup and acceptance metrics), ``probe`` (acceptance and early-exit statistics from
one vanilla-SD pass), ``plan`` (the Mirror-SD latency law on measured costs; sweeps) and ``report``."""
