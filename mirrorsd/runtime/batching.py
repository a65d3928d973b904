"""Continuous batching: the forwards of many generation threads, one forward per step.

Each request decodes on a thread of its own with its method's roles unchanged (proposers, verifiers, sampling noise,
stop conditions). A thread that joins a :class:`Batcher` sends its batchable forwards here (through the hook of
:mod:`mirrorsd.execution`) and waits; once every member is waiting, one of them runs a **step**: every waiting
window (1 row for a plain step, 1 + k for a verification window or tree) and a bounded chunk of each waiting prompt
go through one ragged C++ forward per model and layer range, and the waiting LM heads through one product. A
request joins at its first forward and leaves when its thread is done, without touching the others' caches: each
sequence keeps its own contiguous cache (:class:`~mirrorsd.kv_cache.KVCache`; rollback stays ``truncate``).

Why contiguous caches, not paged blocks: on the CPU the cache lives in ordinary memory that grows by doubling, so
paging would buy no capacity, and the attention kernel reads one sequence's keys as one strided block.

Why threads and not a rewritten loop: the roles call the model where they need it (a draft's catch-up, Mirror-SD's
exit, Speculative Streaming's passes), so the forward is the one place every method meets; the rows of one step are
exactly what each request would have run alone, and :func:`~mirrorsd.execution.ragged_layers` gives each the bits it
gets alone, so no token can change. A forward that cannot batch (an fp32 or CUDA model, several rows, autograd) runs
on its own thread as it does today.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..execution import LayerCall, batched_by, ragged_layers
from ..model import PREFILL_CHUNK

if TYPE_CHECKING:
    from ..model import Transformer

#: Rows a step may spend on waiting prompts beyond the running windows (llama.cpp's server and vLLM bound a step's
#: prefill the same way), so running streams keep their pace while a long prompt arrives.
PREFILL_ROWS = 32


@dataclass(eq=False)
class _Waiting:
    """A forward a member waits on: a layer range over one window (``call``), or the final norm and LM head."""

    model: Transformer
    call: LayerCall | None = None
    start: int = 0
    end: int = 0
    hidden: torch.Tensor | None = None  # the head's input [1, T, hidden]
    done: int = 0  # rows of the window run so far (a prompt runs in chunks across steps)
    outputs: list[torch.Tensor] = field(default_factory=list)
    result: torch.Tensor | None = None
    error: BaseException | None = None
    finished: bool = False

    @property
    def rows(self) -> int:
        return self.call.hidden.shape[1] if self.call is not None else self.hidden.shape[1]

    prompt: bool = False  # set by the batcher: a long causal window, run in chunks across steps

    def splittable(self, rows: int) -> bool:
        """A causal window without stream rows longer than ``rows``: a prompt, which may run in pieces with the same
        bits (shorter ones, a plain step or a verification window, always run whole)."""
        return self.call is not None and self.call.mask is None and self.call.streams is None and self.rows > rows


@dataclass(frozen=True)
class StepRecord:
    """One batched step, for the log and ``/metrics``."""

    at: float
    windows: int  # windows in it (a plain step's row, a verification window or tree, a draft's catch-up)
    prompts: int  # prompt chunks in it
    rows: int  # rows through the layers
    prefill_rows: int  # of them, rows of prompts
    seconds: float

    @property
    def speculation_rows(self) -> int:
        """Rows beyond one per window: draft tokens under verification, tree and stream rows, a draft's catch-up."""
        return self.rows - self.prefill_rows - self.windows


class _Member:
    counted = False


class Batcher:
    """Runs the waiting forwards of its member threads together (see the module docstring).

    ``prefill_rows``: rows of waiting prompts a step takes beside the running windows (a prompt alone on the batcher
    takes at least this many, and ``PREFILL_CHUNK`` rows a step when nothing else waits)."""

    def __init__(self, prefill_rows: int = PREFILL_ROWS, history: int = 4096,
                 on_step: Callable[[StepRecord], None] | None = None) -> None:
        if prefill_rows < 1:
            raise ValueError(f"prefill_rows must be at least 1, got {prefill_rows}")
        self.prefill_rows = prefill_rows
        self._cond = threading.Condition()
        self._running = 0  # members between forwards
        self._waiting: list[_Waiting] = []
        self._executing = False
        self._local = threading.local()
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self.total_steps = 0
        self.on_step = on_step

    @property
    def members_running(self) -> int:
        return self._running

    @contextmanager
    def member(self) -> Iterator[None]:
        """This thread's forwards go through the batcher for the block. It counts as a member from its first
        forward (what it does before, a plan or a tokenizer call, holds nobody up) until the block ends."""
        me = _Member()
        self._local.member = me
        try:
            with batched_by(self):
                yield
        finally:
            self._local.member = None
            with self._cond:
                if me.counted:
                    self._running -= 1
                    self._steps_while_idle()

    # -- the hook (mirrorsd.execution.ForwardBatcher) -------------------------------------------------------------

    def run_layers(self, model: Transformer, call: LayerCall, start: int, end: int) -> torch.Tensor:
        return self._wait(_Waiting(model, call, start, end))

    def head(self, model: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        return self._wait(_Waiting(model, hidden=hidden))

    # -- the barrier ----------------------------------------------------------------------------------------------

    def _wait(self, item: _Waiting) -> torch.Tensor:
        me = getattr(self._local, "member", None)
        with self._cond:
            if me is not None and not me.counted:
                me.counted = True  # joins waiting: the running count is unchanged
            else:
                self._running -= 1
            self._waiting.append(item)
            while not item.finished:
                if not self._steps_while_idle():
                    self._cond.wait()
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _steps_while_idle(self) -> bool:
        """Run steps while every member waits (the lock is held on entry and exit, released during a step). Returns
        whether any ran."""
        ran = False
        while self._running == 0 and self._waiting and not self._executing:
            self._executing = True
            work = self._select()
            self._cond.release()
            try:
                record = self._step(work)
            finally:
                self._cond.acquire()
                self._executing = False
            self.steps.append(record)
            self.total_steps += 1
            if self.on_step is not None and record.rows:
                self.on_step(record)
            for item in [w for w, _ in work if w.finished]:
                self._waiting.remove(item)
                self._running += 1
            self._cond.notify_all()
            ran = True
        return ran

    def _select(self) -> list[tuple[_Waiting, int]]:
        """This step's work: each waiting window whole, and chunks of the waiting prompts (oldest first) within
        ``prefill_rows`` (``PREFILL_CHUNK`` when nothing else waits)."""
        for w in self._waiting:
            w.prompt = w.prompt or w.splittable(self.prefill_rows)
        windows = [(w, w.rows) for w in self._waiting if not w.prompt]
        prompts = [w for w in self._waiting if w.prompt]
        budget = self.prefill_rows if windows or len(prompts) > 1 else None
        work = list(windows)
        for w in prompts:
            left = w.rows - w.done
            take = min(left, PREFILL_CHUNK if budget is None else budget)
            if take <= 0:
                break
            work.append((w, take))
            if budget is not None:
                budget -= take
        return work

    def _step(self, work: list[tuple[_Waiting, int]]) -> StepRecord:
        """One forward per (model, layer range) and one head product per model, outside the lock."""
        began = time.perf_counter()
        groups: dict[tuple, list[tuple[_Waiting, int]]] = {}
        for w, rows in work:
            key = (id(w.model), w.start, w.end) if w.call is not None else (id(w.model), "head")
            groups.setdefault(key, []).append((w, rows))
        rows_run = prefill = windows = prompts = 0
        with batched_by(None), torch.inference_mode():
            for members in groups.values():
                try:
                    if members[0][0].call is not None:
                        self._layers(members)
                        rows_run += sum(rows for _, rows in members)
                        prefill += sum(rows for w, rows in members if w.prompt)
                        prompts += sum(w.prompt for w, _ in members)
                        windows += sum(not w.prompt for w, _ in members)
                    else:
                        self._heads(members)
                except Exception as e:  # every member of the failed forward gets the error on its own thread
                    for w, _ in members:
                        w.error, w.finished = e, True
        return StepRecord(began, windows, prompts, rows_run, prefill, time.perf_counter() - began)

    @staticmethod
    def _layers(members: list[tuple[_Waiting, int]]) -> None:
        first = members[0][0]
        pieces = []
        for w, rows in members:
            c = w.call
            if w.prompt:
                a, b = w.done, w.done + rows
                pieces.append(LayerCall(c.hidden[:, a:b], c.positions[:, a:b], c.cache))
            else:
                pieces.append(c)
        outputs = ragged_layers(first.model, pieces, first.start, first.end)
        for (w, rows), out in zip(members, outputs, strict=True):
            w.outputs.append(out)
            w.done += rows
            if w.done == w.rows:
                w.result = w.outputs[0] if len(w.outputs) == 1 else torch.cat(w.outputs, 1)
                w.outputs, w.finished = [], True

    @staticmethod
    def _heads(members: list[tuple[_Waiting, int]]) -> None:
        model = members[0][0].model
        hidden = [w.hidden for w, _ in members]
        logits = model.logits(torch.cat(hidden, 1))  # row-local (execution.head_batchable): each row's own bits
        for (w, _), out in zip(members, logits.split([h.shape[1] for h in hidden], 1), strict=True):
            w.result, w.finished = out, True
