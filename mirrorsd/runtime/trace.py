"""Spans per lane (target, draft), for step statistics and Chrome/Perfetto traces.

Every span uses ``time.perf_counter`` from whichever thread records it, so spans of the target and the draft
are on one clock and their overlap in the trace is real overlap in wall time. On a GPU that clock times the host
issuing work, not the work: a tracer made for a CUDA device also records a CUDA event at each end of a span, on the
stream its thread issues to, and :meth:`Tracer.resolve` moves the spans onto the device's clock (both lanes' streams
on one device share it), so durations and overlaps are the kernels' own.
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
    """Collects spans; ``list.append`` is atomic under the GIL, so both lanes may record concurrently.

    ``device``: a CUDA device whose streams every span's work is issued to (one device: events on two devices share
    no clock) makes it record CUDA events too, and :attr:`device_times` true."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.origin = time.perf_counter()
        self.spans: list[Span] = []
        self.device_times = device is not None and device.type == "cuda"
        self.device = device
        self._pending: list[tuple[Span, Any, Any]] = []  # spans whose events :meth:`resolve` has not read yet
        if self.device_times:
            with torch.cuda.device(device):
                self._zero = torch.cuda.Event(enable_timing=True)
                self._zero.record()
            self._zero_host = time.perf_counter()

    @contextmanager
    def span(self, lane: str, name: str, **args: Any) -> Iterator[Span]:
        s = Span(lane, name, time.perf_counter(), 0.0, args)
        begin = self._event()
        try:
            yield s
        finally:
            s.end = time.perf_counter()
            if begin is not None:
                self._pending.append((s, begin, self._event()))
            self.spans.append(s)

    def _event(self) -> Any:
        """A timing event recorded on this thread's current stream of the tracer's device (not the current device:
        on cuda:1 that is cuda:0's idle stream), or None (host times only)."""
        if not self.device_times:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def resolve(self) -> None:
        """Put the spans recorded so far on the device's clock (waiting for their work to finish): start and end
        become the events' times, anchored where the tracer began, and ``args["host_ms"]`` keeps the host's
        duration. Call it where both lanes' work is known to be done (a rollout joined, a verdict read): then it
        waits for nothing (a finished event is only queried)."""
        pending, self._pending = self._pending, []
        for span, begin, end in pending:
            if not end.query():
                end.synchronize()
            span.args["host_ms"] = round(span.seconds * 1e3, 4)
            span.start = self._zero_host + self._zero.elapsed_time(begin) / 1e3
            span.end = self._zero_host + self._zero.elapsed_time(end) / 1e3


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
