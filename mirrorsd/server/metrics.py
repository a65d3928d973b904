"""Prometheus metrics at ``GET /metrics``, named like vLLM's under a ``mirrorsd:`` prefix.

Speculative decoding (vLLM's ``spec_decode_*``), per decoding step of every request:

- ``num_drafts``: steps that drafted at least one token; ``num_draft_tokens``: window positions drafted (a
  tree counts its depth); ``num_accepted_tokens``: draft tokens the target accepted;
  ``num_accepted_tokens_per_pos{position}``: steps that accepted the draft token at window position
  ``position`` (0-based). Acceptance rate = accepted / draft tokens; mean accepted length (tokens per step) =
  1 + accepted / drafts.

Continuous batching, per step (one batched forward): ``batch_size`` (windows and prompt chunks in it),
``step_rows`` (rows through the layers), ``step_prefill_rows`` (of them, rows of prompts: what the prefill pace chose)
and ``step_speculation_rows`` (rows beyond one per window: draft tokens under verification, tree and stream rows, a
draft's catch-up).

Prefix caching (vLLM's names), per finished request: ``prefix_cache_queries`` (its prompt tokens) and
``prefix_cache_hits`` (of them, tokens whose keys and values the prefix cache held, so they were not prefilled).

Latency, per request: time to first token (arrival to the first committed token, queueing included), time
per output token ``(e2e - ttft) / (completion tokens - 1)``, and end-to-end latency. Under speculative
decoding one SSE chunk may carry several tokens, so the time between chunks is *not* the time per token.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ..batching import StepRecord

PREFIX = "mirrorsd:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, model: str, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        disable_created_metrics()  # no *_created series next to every counter (as vLLM)
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.model = model
        self.num_steps = counter("num_decode_steps", "decoding steps (one target verification each), all methods")
        self.num_drafts = counter("spec_decode_num_drafts", "decoding steps that drafted at least one token")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "window positions drafted")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "draft tokens the target accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "steps that accepted the draft token at this window position (0-based)",
                                        ("position",))
        self.requests = counter("request_success", "finished requests by finish reason (abort: client left)",
                                ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "completion tokens of finished requests")
        self.prefix_queries = counter("prefix_cache_queries", "prompt tokens of finished requests")
        self.prefix_hits = counter("prefix_cache_hits", "prompt tokens restored from the prefix cache, not prefilled")
        self.ttft = histogram("time_to_first_token_seconds", "arrival to the first committed token",
                              LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "(e2e - ttft) / (completion tokens - 1) per request", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "arrival to the last token", LATENCY_BUCKETS)
        self.batch_size = histogram("batch_size", "windows and prompt chunks per batched step", ROW_BUCKETS)
        self.step_rows = histogram("step_rows", "rows through the layers per batched step", ROW_BUCKETS)
        self.step_prefill_rows = histogram("step_prefill_rows", "rows of prompts per batched step", ROW_BUCKETS)
        self.step_speculation_rows = histogram("step_speculation_rows", "rows beyond one per window per batched step",
                                               ROW_BUCKETS)
        for name, doc, read in (("num_requests_waiting", "requests in the queue", waiting),
                                ("num_requests_running", "requests being decoded", running)):
            Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model).set_function(read)

    def step(self, drafted: int, accepted: int) -> None:
        """One decoding step of some request (called from the engine thread)."""
        self.num_steps.labels(self.model).inc()
        if drafted:
            self.num_drafts.labels(self.model).inc()
            self.num_draft_tokens.labels(self.model).inc(drafted)
            self.num_accepted_tokens.labels(self.model).inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(self.model, str(position)).inc()

    def batch_step(self, record: StepRecord) -> None:
        """One batched step (called under the batcher's lock by the thread that ran it: the engine or a lone member)."""
        self.batch_size.labels(self.model).observe(record.windows + record.prompts)
        self.step_rows.labels(self.model).observe(record.rows)
        self.step_prefill_rows.labels(self.model).observe(record.prefill_rows)
        self.step_speculation_rows.labels(self.model).observe(record.speculation_rows)

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                 ttft: float | None, e2e: float) -> None:
        self.requests.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.prefix_queries.labels(self.model).inc(prompt_tokens)
        self.prefix_hits.labels(self.model).inc(cached_tokens)
        self.generation_tokens.labels(self.model).inc(completion_tokens)
        if ttft is not None:
            self.ttft.labels(self.model).observe(ttft)
            if completion_tokens > 1:
                self.tpot.labels(self.model).observe((e2e - ttft) / (completion_tokens - 1))
        self.e2e.labels(self.model).observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
