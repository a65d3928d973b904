"""Wall-clock spans per lane (target, draft), for step statistics and Chrome/Perfetto traces.

Every span uses ``time.perf_counter`` from whichever thread records it, so spans of the target and the draft
are on one clock and their overlap in the trace is real overlap in wall time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Span:
    lane: str  # "target" or "draft"
    name: str
    start: float  # perf_counter seconds
    end: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Tracer:
    """Collects spans; ``list.append`` is atomic under the GIL, so both lanes may record concurrently."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.spans: list[Span] = []

    @contextmanager
    def span(self, lane: str, name: str, **args: Any) -> Iterator[Span]:
        s = Span(lane, name, time.perf_counter(), 0.0, args)
        try:
            yield s
        finally:
            s.end = time.perf_counter()
            self.spans.append(s)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA runs asynchronously, so a timer must stop after the work, not its
    launch (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def overlap(a: Span | None, b: Span | None) -> float:
    """Seconds during which both spans ran."""
    if a is None or b is None:
        return 0.0
    return max(0.0, min(a.end, b.end) - max(a.start, b.start))


def write_chrome_trace(spans: list[Span], path: str | Path, origin: float | None = None,
                       metadata: dict[str, Any] | None = None) -> Path:
    """Chrome trace-event JSON (open in chrome://tracing or ui.perfetto.dev): one lane per ``Span.lane``."""
    origin = min((s.start for s in spans), default=0.0) if origin is None else origin
    lanes = sorted({s.lane for s in spans}, key=lambda lane: (lane != "target", lane))
    tid = {lane: i for i, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid[lane], "args": {"name": lane}} for lane in lanes]
    for s in spans:
        events.append({"ph": "X", "name": s.name, "cat": s.lane, "pid": 0, "tid": tid[s.lane],
                       "ts": round((s.start - origin) * 1e6, 1), "dur": round(s.seconds * 1e6, 1),
                       "args": s.args})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata or {}}))
    return path
