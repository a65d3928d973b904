"""Continuous batching: the forwards of many generation threads, one forward per step.

Each request decodes on a thread of its own with its method's roles unchanged (proposers, verifiers, sampling noise,
stop conditions). A thread that joins a :class:`Batcher` sends its batchable forwards here (through the hook of
:mod:`mirrorsd.execution`) and waits; once every member is waiting, the engine thread runs a **step**: every waiting
window (1 row for a plain step, 1 + k for a verification window or tree) and a bounded chunk of each waiting prompt
go through one ragged C++ forward per model and layer range, and the waiting LM heads through one product. A
request joins at its first forward and leaves when its thread is done, without touching the others' caches: each
sequence keeps its own contiguous cache (:class:`~mirrorsd.kv_cache.KVCache`; rollback stays ``truncate``). A member
alone runs its steps on its own thread, with nothing handed over: one request runs at its speed alone.

Why contiguous caches, not paged blocks: on the CPU the cache lives in ordinary memory that grows by doubling, so
paging would buy no capacity, and the attention kernel reads one sequence's keys as one strided block.

Why threads and not a rewritten loop: the roles call the model where they need it (a draft's catch-up, Mirror-SD's
exit, Speculative Streaming's passes), so the forward is the one place every method meets; the rows of one step are
exactly what each request would have run alone, and :func:`~mirrorsd.execution.ragged_layers` gives each the bits it
gets alone, so no token can change. A forward that cannot batch (an fp32 or CUDA model, several rows, autograd) runs
on its own thread as it does today.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .decoding.engine import GenerationStats, RequestState, budgeted_by
from .errors import Cancelled
from .execution import LayerCall, batched_by, ragged_layers, release_thread_team
from .model import PREFILL_CHUNK

if TYPE_CHECKING:
    from torch import nn

    from .model import Transformer

log = logging.getLogger(__name__)

#: What a step with prompt rows may cost, in running windows' own steps, when the prompt rows are paced
#: (``prefill_rows=None``, the default): the running streams' time per token at most doubles while a prompt arrives,
#: and the prompt gets half the machine. On a CPU a prompt row costs about the same in any step, so these two halves
#: trade against each other: a smaller pace keeps streams faster and the prompt's first token later in proportion.
PREFILL_PACE = 2.0
#: Prompt rows a paced step takes before the batch has measured its cost line (and a second step size to fit it by).
PREFILL_START = 8
#: A causal window of up to this many rows (a short prompt, a draft's catch-up, a verification window) runs whole in
#: one step; a longer one is a prompt, run in chunks (``Batcher.whole_rows``).
WHOLE_ROWS = 32


#: How a batch spends draft rows: ``goodput`` caps each request's window by the goodput rule (:class:`Goodput`),
#: ``fixed`` leaves every method its own window whatever the load.
SPECULATION = ("goodput", "fixed")


class Fixed:
    """No cap on the windows: each method drafts its own (``speculation="fixed"``); methods still learn the batch
    size (Mirror-SD's κ and stream count follow it, App. D.1)."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    def batch(self) -> int:
        return max(1, self.batcher.members)

    def limit(self, state: RequestState) -> int | None:
        return None


class Goodput(Fixed):
    """The goodput rule (SmartSpec, arXiv 2406.14066, applied per request): a draft row in a step of ``R`` rows
    costs every request in the batch the step's marginal time ``b / (a + b R)`` (the measured cost curve of the
    request's target's own layer forwards: a draft's cheaper rows in the same steps would bend it),
    plus, for a draft model, the time of the draft step the batch waits for (the request's own wall time per draft
    forward), that is ``S * (b + d) / (a + b R)`` committed tokens for a batch committing ``S`` tokens a step; the
    ``k``-th draft token of a request whose tokens are accepted at rate ``α`` yields ``α^k``. So a request drafts the
    largest ``k`` with ``α^k`` above that price: less as the batch grows, and none once a row costs more than any
    draft token brings (the plain batched step). Alone, a request drafts its method's own window (today's
    single-request speed) unless not even the first draft token pays: then it decodes plainly, as ``ar`` would (a
    timed method, below: unless its measured steps say so). Prompt chunks are paced on whole steps instead
    (:meth:`Batcher.prefill_budget`): what the running streams feel is the whole step.

    ``α`` is the request's own acceptance over its last :attr:`RECENT` steps that drafted, however long ago (the
    maximum-likelihood rate of a geometric run: accepted tokens over accepted tokens plus rejections; so a cap does
    not lift itself by plain steps), shrunk toward its method's pooled rate over the last ``PEERS`` requests by
    ``PRIOR`` pseudo-observations: one early rejected window must not cap a request for good (a suffix match, say),
    and a new request starts from what its method earns here (one of a method that does not pay never pays for a
    first window, nor for its draft's prompt). The first request of a method drafts freely until it has a figure.

    A method whose drafting step does work of its own (``Roles.timed_steps``: an ``ss`` pass's stream rows, their head
    and the pruning exit; ``sd``'s draft model, whose forwards per draft token the suffix lookup lowers) costs the batch
    that work too, which the row-cost curve does not see: an ``ss`` pass alone took ~58 ms where its batched rows took
    ~32 and ``ar``'s whole step ~31 (``docs/server.md``). Its steps are timed (:class:`StepWalls`), and it drafts only
    while its drafting steps commit more tokens per second than its plain ones, both measured in the batch
    (:meth:`StepWalls.measured_pays`); that verdict comes before the row-cost line, which may still cap a window it
    lets draft in a busy batch. Alone, the verdict decides: a modelled price had kept ``sd`` plain for good at one
    request after its first windows (.40 accepted), 13% slower than its own window over Spec-Bench's first turns. To
    time both kinds, one batch step is plain for all the method's members after :attr:`PROBE_EVERY` drafting rounds,
    and a drafting round is timed again after :attr:`REPROBE_AFTER` plain rounds (a round: a step of each member; a
    plain step timed beside drafting ones would wait for their rows and heads, and look as dear as they). Only such
    methods are timed: pricing ``suffix``'s steps so cost its windows up to 15% alone, where its lookups cost little
    and its long accepted runs are worth more than a geometric rate says."""

    RECENT = 16  # steps of a request's acceptance, and of the batch's row level, that the rule reads
    PEERS = 32  # requests of a method whose recent acceptance a new request starts from
    PRIOR = 4.0  # pseudo-observations of the pooled rate in each request's own
    PROBE_EVERY = 16  # drafting rounds of a method after which its members step plainly once, to time a plain step
    REPROBE_AFTER = 64  # plain rounds of a method after which a drafting round is timed again

    def __init__(self, batcher: Batcher) -> None:
        super().__init__(batcher)
        self._peers: dict[str, deque[_Drafted]] = {}  # method -> its latest requests' steps that drafted
        self._drafted: dict[int, _Drafted] = {}  # id of a request's statistics -> its tracker (kept past its
        # eviction from the pool: with more than PEERS running requests of a method, each would rebuild its own)
        self._curves: dict[int, tuple[float, float]] = {}  # a target's model_key -> its last fitted row-cost line
        self._walls: dict[str, StepWalls] = {}  # method -> its latest steps' wall times

    def limit(self, state: RequestState) -> int | None:
        busy = self.batcher.members
        stats = state.stats
        if stats.step_s or stats.method in self._walls:  # a timed method (a new request of one too): its measured
            # verdict first (a row-cost line that looks flat must not override it: at 2 requests a noisy line sent
            # ss drafting in half the steps where it did not pay)
            walls = self._walls.setdefault(stats.method, StepWalls())
            walls.observe(stats)
            walls.decide(self.batcher.total_steps, stats)
            if walls.probing:
                return 0  # the method's members step plainly once, to time a plain step
            if walls.pays is False and not walls.retiming:
                return 0  # (after many plain rounds, a drafting round is timed again: the load may have changed)
            if busy <= 1:
                return None  # alone, its measured steps are the whole story: the row line prices other members'
                # time, and its draft term (a draft forward's wall, its prompt's catch-up in it) priced sd out alone
        alpha = self.acceptance(stats)
        target = model_key(state.request.target)
        recent = []  # the target's running rows in its steps (a head step's none); a draft's steps are not its
        for r in list(self.batcher.steps)[-self.RECENT:]:
            mine = r.of(target)
            if mine is not None:
                recent.append(mine.rows - mine.prefill_rows)
        level = sum(recent) / len(recent) if recent else float(busy)
        fitted = self.batcher.cost_curve(level, model=target)
        if fitted is not None:
            self._curves[target] = fitted
        # (a batch that stepped plainly for a while has one size of step to fit: its rows cost what they did)
        curve = self._curves.get(target)
        if alpha is None or curve is None:
            return None
        a, b = curve
        # A draft model's position is a step of its own that the whole batch waits for: its wall time per forward.
        drafting = stats.draft_s / stats.draft_forwards if stats.draft_forwards else self._drafting(stats)
        price = busy * (1 + alpha) * (b + drafting) / (a + b * level)  # tokens a draft token costs the batch
        if price <= 0.0 or alpha >= 0.999:
            return None  # rows cost nothing, or every draft token is accepted: the method's own window
        if price >= 1.0 or alpha <= price:
            return 0
        return None if busy <= 1 else int(math.log(price) / math.log(alpha))

    def acceptance(self, stats: GenerationStats) -> float | None:
        """``α`` for a request (see the class docstring), or None while no request of its method has drafted. Over
        each request's last :attr:`RECENT` steps that drafted, not its last steps: a method the rule has kept plain
        for a while would otherwise have no rate, and draft freely again as if it were new."""
        peers = self._peers.setdefault(stats.method, deque(maxlen=self.PEERS))
        own = self._drafted.get(id(stats))
        if own is None or own.stats is not stats:
            own = self._drafted[id(stats)] = _Drafted(stats)
            peers.append(own)
            if len(self._drafted) > 4 * self.PEERS:  # (ended requests' entries: the oldest go first)
                drop_oldest(self._drafted)
        pooled_tokens = pooled_rejections = 0
        for peer in list(peers):
            tokens, rejections = peer.outcomes()
            pooled_tokens, pooled_rejections = pooled_tokens + tokens, pooled_rejections + rejections
        if pooled_tokens + pooled_rejections == 0:
            return None
        pooled = (pooled_tokens + 1) / (pooled_tokens + pooled_rejections + 2)  # (Laplace: a few windows say little)
        tokens, rejections = own.outcomes()
        return (tokens + self.PRIOR * pooled) / (tokens + rejections + self.PRIOR)

    def _drafting(self, stats: GenerationStats) -> float:
        """Seconds per draft forward of the method's peers (a request that has not drafted yet)."""
        peers = [t for t in (p.drafting() for p in list(self._peers.get(stats.method, ()))) if t[1]]
        return sum(s for s, _ in peers) / sum(f for _, f in peers) if peers else 0.0


class StepWalls:
    """A method's latest steps' wall times (:attr:`GenerationStats.step_s`), plain (a budget of 0) and drafting, in
    the order its requests took them, and what its members do in the batch step they are about to take (decided by
    the first of them to ask: :meth:`decide`). Every member thread reports here without a lock: a lost count only
    moves a probe by a step."""

    KEEP = 16  # steps of each kind
    MIN_DRAFTING = 4  # drafting steps timed before deciding (a re-timed run is not judged on its first step)

    def __init__(self) -> None:
        self.plain: deque[float] = deque(maxlen=self.KEEP)
        self.drafting: deque[tuple[float, int]] = deque(maxlen=self.KEEP)  # (seconds, tokens committed)
        self.since_plain = 0  # drafting steps timed since the last plain one
        self.since_drafting = 0  # plain steps timed since the last drafting one
        self.step = -1  # the batch step last asked about
        self.callers: set[int] = set()  # the members of the method that asked about it
        self.members = 1  # members of the method in the last round (not the batch's: other methods' count not here)
        self.probing = False  # this step times a plain one
        self.pays: bool | None = None  # this step drafts (None: not both kinds timed yet)
        self.retiming = False  # this step drafts to time drafting again after a long plain run
        # id of a request's statistics -> (a weak reference to them, the steps taken in): an id alone is reused once
        # its object is collected, and a later request at the same step count would have its step skipped
        self._seen: dict[int, tuple[weakref.ref, int]] = {}

    def observe(self, stats: GenerationStats) -> None:
        """Takes a request's last step, once (the rule sees each request once per step, before it; a second look at
        the same step must not count it twice). Every step not sent plain is a drafting one, those with nothing to
        verify too (an ``ss`` pass after one whose guesses were all pruned, a third of its steps on Spec-Bench: they
        run the stream rows for one token, and drafting's price includes them), but for a fresh start: a request's
        first step, or the first after its plain one. That one is the probe's cost, not drafting's, and a whole
        round of them after a probe would fill the drafting record at 16 members and turn drafting off for good."""
        n = len(stats.step_s)
        seen = self._seen.get(id(stats))
        if not n or len(stats.step_log) < n or (seen is not None and seen[0]() is stats and seen[1] == n):
            return
        self._seen[id(stats)] = (weakref.ref(stats), n)
        if len(self._seen) > 4 * self.KEEP:  # (ended requests' entries: the oldest go first)
            drop_oldest(self._seen)
        seconds, step = stats.step_s[-1], stats.step_log[n - 1]
        if step.get("limit") == 0:
            self.plain.append(seconds)
            self.since_plain, self.since_drafting = 0, self.since_drafting + 1
        elif n > 1 and stats.step_log[n - 2].get("limit") != 0:
            if self.since_drafting >= Goodput.REPROBE_AFTER * self.members:
                self.drafting.clear()  # timed again after a long plain run: the old windows' load is gone
            self.drafting.append((seconds, step["accepted"] + 1))
            self.since_plain, self.since_drafting = self.since_plain + 1, 0

    def decide(self, step: int, asking: GenerationStats) -> None:
        """What the method's members do in batch step ``step`` (``asking``: a member's statistics), decided once by the
        first of them to ask, so a round is all plain or all drafting (a plain step beside drafting ones waits for
        their work and looks as dear): plain once :attr:`Goodput.PROBE_EVERY` drafting rounds have passed since the
        last plain step (counted in drafting steps of any member, every other round of the batch went plain at 8
        requests); drafting while it :meth:`measured_pays`, or to time it again after :attr:`Goodput.REPROBE_AFTER`
        plain rounds."""
        if step == self.step:
            self.callers.add(id(asking))
            return
        if self.callers:
            self.members = len(self.callers)
        self.step, self.callers = step, {id(asking)}
        self.probing = self.since_plain >= Goodput.PROBE_EVERY * self.members
        self.pays = self.measured_pays()
        self.retiming = self.since_drafting >= Goodput.REPROBE_AFTER * self.members

    def measured_pays(self) -> bool | None:
        """Whether the method's drafting steps commit more tokens per second than its plain ones: their mean tokens
        committed against their median wall time over the plain steps' (the tokens per pass a drafting step needs),
        or None until both kinds are timed (:attr:`MIN_DRAFTING` drafting steps). Measured, not modelled: a
        Speculative Streaming pass commits a tree's path, which a geometric rate over draft tokens overrates, and
        costs its stream rows, heads and pruning. (Its own tokens against its own steps: in a batch of other
        methods, what its work costs them is not counted.)"""
        plain, drafting = list(self.plain), list(self.drafting)  # (other members' threads append as we read)
        if not plain or len(drafting) < self.MIN_DRAFTING:
            return None
        tokens = sum(c for _, c in drafting) / len(drafting)
        return tokens > statistics.median(s for s, _ in drafting) / statistics.median(plain)


class _Drafted:
    """A request's last :attr:`Goodput.RECENT` steps that drafted, taken in as its steps come (its history is read
    once, not at every step; the members of a batch read each other's at once, hence the lock). It holds the
    request's statistics weakly: an ended request leaves only what the rule reads (the whole statistics of 128
    ended requests, step logs and spans included, were kept: ~260 MB for Mirror-SD at 2,048 tokens each)."""

    def __init__(self, stats: GenerationStats) -> None:
        self._stats = weakref.ref(stats)
        self.read = 0  # steps taken in
        self.steps: deque[tuple[int, int]] = deque(maxlen=Goodput.RECENT)  # (accepted, drafted)
        self.draft_s, self.draft_forwards = 0.0, 0  # as last read
        self.lock = threading.Lock()

    @property
    def stats(self) -> GenerationStats | None:
        """The request's statistics while anything else holds them (its request runs)."""
        return self._stats()

    def outcomes(self) -> tuple[int, int]:
        """:func:`outcomes` of those steps."""
        stats = self.stats
        with self.lock:
            if stats is not None:
                n = min(len(stats.accepted), len(stats.drafted))  # (its thread may be between the two appends)
                for i in range(self.read, n):
                    if stats.drafted[i]:
                        self.steps.append((stats.accepted[i], stats.drafted[i]))
                self.read = max(self.read, n)
            steps = list(self.steps)
        return outcomes([a for a, _ in steps], [d for _, d in steps])

    def drafting(self) -> tuple[float, int]:
        """The request's draft seconds and draft forwards so far."""
        stats = self.stats
        if stats is not None:
            self.draft_s, self.draft_forwards = stats.draft_s, stats.draft_forwards
        return self.draft_s, self.draft_forwards


def outcomes(accepted: list[int], drafted: list[int]) -> tuple[int, int]:
    """Accepted draft tokens and rejections of windows (a window accepted short of its end ended in one)."""
    tokens = sum(a for a, d in zip(accepted, drafted, strict=True) if d)
    return tokens, sum(a < d for a, d in zip(accepted, drafted, strict=True) if d)


@dataclass(eq=False)
class _Waiting:
    """A forward a member waits on: a layer range over one window (``call``), or the final norm and LM head."""

    model: Transformer
    call: LayerCall | None = None
    start: int = 0
    end: int = 0
    hidden: torch.Tensor | None = None  # the head's input [1, T, hidden]
    head: nn.Module | None = None  # None: the model's LM head
    done: int = 0  # rows of the window run so far (a prompt runs in chunks across steps)
    outputs: list[torch.Tensor] = field(default_factory=list)
    result: torch.Tensor | None = None
    error: BaseException | None = None
    cancelled: threading.Event | None = None  # its member's request was cancelled: a prompt stops between chunks
    computed: bool = False  # set by the step, outside the lock
    finished: bool = False  # published by the engine under the lock, with the running count: a member woken by
    # another's notify must not leave before the engine counts it as running again

    @property
    def rows(self) -> int:
        return self.call.hidden.shape[1] if self.call is not None else self.hidden.shape[1]

    prompt: bool = False  # set by the batcher: a long causal window, run in chunks across steps

    def splittable(self, rows: int) -> bool:
        """A causal window without stream rows longer than ``rows``: a prompt, which may run in pieces with the same
        bits (shorter ones, a plain step or a verification window, always run whole)."""
        return self.call is not None and self.call.mask is None and self.call.streams is None and self.rows > rows


def drop_oldest(table: dict) -> None:
    """Forget a full table's oldest entry. Member threads update these tables without a lock, so two may pick the
    same oldest key, or one may insert while another looks: a key already gone, or a table changing under the look,
    is let go (the next insert drops one again), never raised into a request."""
    with suppress(RuntimeError, StopIteration):
        table.pop(next(iter(table)), None)


_MODEL_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its serial (see model_key)
_SERIALS = itertools.count()


def model_key(model: Transformer) -> int:
    """A number for ``model`` that no other model of this process ever gets: the step records and the goodput rule's
    lines outlive a step, and an ``id()`` is reused once its object is collected (a target loaded after another was
    dropped would inherit the old one's cost line)."""
    key = _MODEL_KEYS.get(model)
    if key is None:
        key = _MODEL_KEYS[model] = next(_SERIALS)
    return key


@dataclass(frozen=True)
class ModelWork:
    """One model's work in a step: its layer rows (none in a head step) and their wall. A target's verification rows
    and a draft's rows cost differently, so the goodput rule reads the target's alone."""

    model: int  # the model's :func:`model_key`
    rows: int
    prefill_rows: int
    seconds: float


@dataclass(frozen=True)
class StepRecord:
    """One batched step, for the log and ``/metrics``."""

    at: float
    windows: int  # windows in it (a plain step's row, a verification window or tree, a draft's catch-up)
    prompts: int  # prompt chunks in it
    rows: int  # rows through the layers
    prefill_rows: int  # of them, rows of prompts
    seconds: float
    models: tuple[ModelWork, ...] = ()  # each model's part of it

    def of(self, model: int) -> ModelWork | None:
        """The part of the model whose ``id`` is ``model`` in this step, if it had one."""
        return next((m for m in self.models if m.model == model), None)

    @property
    def speculation_rows(self) -> int:
        """Rows beyond one per window: draft tokens under verification, tree and stream rows, a draft's catch-up."""
        return self.rows - self.prefill_rows - self.windows


class _Member:
    counted = False
    cancelled: threading.Event | None = None


class Batcher:
    """Runs the waiting forwards of its member threads together (see the module docstring).

    ``prefill_rows``: rows of waiting prompts a step takes beside the running windows (``PREFILL_CHUNK`` when no
    window waits); None paces them by the batch's measured cost (:data:`PREFILL_PACE`)."""

    def __init__(self, prefill_rows: int | None = None, history: int = 4096,
                 on_step: Callable[[StepRecord], None] | None = None, speculation: str = "goodput") -> None:
        if prefill_rows is not None and prefill_rows < 1:
            raise ValueError(f"prefill_rows must be at least 1, got {prefill_rows}")
        if speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}")
        self.budget = Goodput(self) if speculation == "goodput" else Fixed(self)
        self.prefill_rows = prefill_rows
        self._cond = threading.Condition()
        self._running = 0  # members between forwards
        self._waiting: list[_Waiting] = []
        self._engine: threading.Thread | None = None  # runs the steps (_run_steps)
        self._solo = False  # the only member runs its forwards on its own thread (_claim_solo)
        self._local = threading.local()
        self.steps: deque[StepRecord] = deque(maxlen=history)
        self.total_steps = 0
        self.on_step = on_step

    @property
    def members_running(self) -> int:
        return self._running

    @property
    def members(self) -> int:
        """Members decoding now: between forwards or waiting on one."""
        return self._running + len({id(w) for w in self._waiting})

    def cost_curve(self, near: float, sizes: int = 3, model: int | None = None) -> tuple[float, float] | None:
        """Seconds of a step as ``a + b * rows``, fitted by least squares to the recent steps of at most
        ``4 * near`` rows (a line fits a CPU's cost over a few dozen rows; a 512-row prompt chunk is off it), or None
        while they are too few or of fewer than ``sizes`` sizes. ``model`` (a :func:`model_key`): that model's layer
        forwards only (a draft's cheaper steps would bend a target's line), else whole steps."""
        recent = list(self.steps)[-256:]
        if model is None:
            measured = [(r.rows, r.seconds) for r in recent]
        else:
            measured = [(m.rows, m.seconds) for m in (r.of(model) for r in recent) if m is not None]
        points = [(rows, s) for rows, s in measured if 0 < rows <= max(8.0, 4 * near)]
        if len(points) < 8 or len({rows for rows, _ in points}) < sizes:
            return None
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
        return max(my - slope * mx, 1e-6), slope

    @contextmanager
    def member(self, cancelled: threading.Event | None = None) -> Iterator[None]:
        """This thread's forwards go through the batcher for the block. It counts as a member from its first
        forward (what it does before, a plan or a tokenizer call, holds nobody up) until the block ends. Once
        ``cancelled`` is set, a prompt it runs stops at its next chunk: the forward raises
        :class:`~mirrorsd.errors.Cancelled`."""
        me = _Member()
        me.cancelled = cancelled
        self._local.member = me
        try:
            with batched_by(self), budgeted_by(self.budget):
                yield
        finally:
            # An idle team kept by a thread between requests (one that ran a request alone, on its own team) would
            # slow the engine's forwards for everyone else (:func:`~mirrorsd.execution.release_thread_team`).
            release_thread_team()
            self._local.member = None
            engine = None
            with self._cond:
                if me.counted:
                    self._running -= 1
                    self._cond.notify_all()
                if self._running == 0 and not self._waiting:
                    engine = self._engine
            if engine is not None:  # the last member out waits for the engine thread to end: a daemon thread still
                engine.join(1.0)  # inside torch when the interpreter exits aborts the process

    # -- the hook (mirrorsd.execution.ForwardBatcher) -------------------------------------------------------------

    def run_layers(self, model: Transformer, call: LayerCall, start: int, end: int) -> torch.Tensor:
        return self._wait(_Waiting(model, call, start, end))

    def head(self, model: Transformer, hidden: torch.Tensor, head: nn.Module | None) -> torch.Tensor:
        return self._wait(_Waiting(model, hidden=hidden, head=head))

    # -- the barrier ----------------------------------------------------------------------------------------------

    def _wait(self, item: _Waiting) -> torch.Tensor:
        me = getattr(self._local, "member", None)
        item.cancelled = me.cancelled if me is not None else None
        if item.cancelled is not None and item.cancelled.is_set():  # (the model's own prompt pieces come one by one)
            raise Cancelled()
        if me is not None and self._claim_solo(me) and self._run_solo(item):
            return self._result(item)
        release_thread_team()  # its forwards run on the engine's team; its own ops, an argmax, may have started one
        with self._cond:
            self._solo = False
            if me is not None and not me.counted:
                me.counted = True  # joins waiting: the running count is unchanged
            else:
                self._running -= 1
            self._waiting.append(item)
            if self._engine is None:
                self._engine = threading.Thread(target=self._run_steps, name="mirrorsd-batch", daemon=True)
                self._engine.start()
            self._cond.notify_all()
            self._cond.wait_for(lambda: item.finished)
        return self._result(item)

    @staticmethod
    def _result(item: _Waiting) -> torch.Tensor:
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _claim_solo(self, me: _Member) -> bool:
        """Whether this member is the batch's only one, with nothing waiting: then it runs its forward itself, on its
        own thread and OpenMP team, as the engine would run it alone (the same step, so the same bits and the same
        record). Handing each forward to the engine and back cost a lone ``ss`` request ~20% (an ``ss`` pass has
        five forwards, and the member's own ops between them started a new team after each). A member that joins
        waits for the solo member's next forward, which then goes to the engine with it."""
        with self._cond:
            if self._waiting or self._running != (1 if me.counted else 0):
                return False
            if not me.counted:
                me.counted = True
                self._running += 1
            self._solo = True
            self._cond.notify_all()  # an idle engine ends (its team would slow this thread's)
            return True

    def _run_solo(self, item: _Waiting) -> bool:
        """The forward as :meth:`_run_steps` runs a lone one: a window whole, a prompt in ``PREFILL_CHUNK`` chunks.
        False when a member came to wait before the prompt's last chunk: the rest goes to the engine beside it (a
        long prompt alone must not hold a new request's first step for its whole prefill)."""
        item.prompt = item.splittable(self.whole_rows)
        while True:
            record = self._step([(item, min(item.rows - item.done, PREFILL_CHUNK) if item.prompt else item.rows)])
            with self._cond:
                self._record(record)
                if item.computed:
                    return True
                if item.cancelled is not None and item.cancelled.is_set():
                    item.error = Cancelled()
                    return True
                if self._waiting:
                    return False

    def _record(self, record: StepRecord) -> None:
        """Logs a step (under the lock). A failing ``on_step`` (metrics) is logged: raised here it would end the engine
        thread with its members still waiting, or fail a lone member's computed forward."""
        self.steps.append(record)
        self.total_steps += 1
        if self.on_step is not None and record.rows:
            try:
                self.on_step(record)
            except Exception:
                log.exception("the batcher's on_step callback failed")

    def _run_steps(self) -> None:
        """The engine thread: a step each time every member waits. One thread runs every forward because each
        thread that starts parallel work gets a team of OpenMP workers of its own, which spin for a while after it:
        steps run by whichever member came last left idle teams spinning on the cores the next step needed (~30%
        slower steps on 2 cores). It ends when the last member leaves (a daemon thread still waiting at interpreter
        exit can abort it) or when one member is left to run its own forwards (:meth:`_claim_solo`), and starts again
        at the next forward that waits."""
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._running == 0 or (self._solo and not self._waiting))
                if not self._waiting:  # every member left, or the only one runs its forwards itself (_claim_solo)
                    self._engine = None
                    break
                if self._drop_cancelled():
                    continue
                work = self._select()
                self._cond.release()
                try:
                    record = self._step(work)
                finally:
                    self._cond.acquire()
                self._record(record)
                for item in [w for w, _ in work if w.computed]:
                    item.finished = True
                    self._waiting.remove(item)
                    self._running += 1
                self._cond.notify_all()
        release_thread_team()  # (a solo member's forwards run beside this thread until it ends)

    def _drop_cancelled(self) -> bool:
        """Whether a prompt whose request was cancelled left the waiting forwards (under the lock): its member
        gets :class:`~mirrorsd.errors.Cancelled` instead of the rest of its chunks."""
        dropped = [w for w in self._waiting if w.cancelled is not None and w.cancelled.is_set()
                   and w.splittable(self.whole_rows)]
        for item in dropped:
            item.error, item.computed, item.finished = Cancelled(), True, True
            self._waiting.remove(item)
            self._running += 1
        if dropped:
            self._cond.notify_all()
        return bool(dropped)

    def _select(self) -> list[tuple[_Waiting, int]]:
        """This step's work: the waiting LM heads alone if any wait, else each waiting window whole and chunks of
        the waiting prompts (oldest first) within :meth:`prefill_budget`, or within ``PREFILL_CHUNK`` when no window
        waits (nothing decodes yet to keep at pace).

        Heads go first, alone: a member past its head joins the next layer step. Run beside another member's layers
        instead, the two would stay a half-step apart for good (each step one's layers and the other's head), and
        their layers would never share a forward again: a draft forward or a prompt that one of them alone runs
        puts them so."""
        heads = [(w, w.rows) for w in self._waiting if w.call is None]
        if heads:
            return heads
        for w in self._waiting:
            w.prompt = w.prompt or w.splittable(self.whole_rows)
        windows = [(w, w.rows) for w in self._waiting if not w.prompt]
        prompts = [w for w in self._waiting if w.prompt]
        budget = self.prefill_budget(sum(rows for _, rows in windows)) if windows else PREFILL_CHUNK
        work = list(windows)
        for w in prompts:
            take = min(w.rows - w.done, budget)
            if take <= 0:
                break
            work.append((w, take))
            budget -= take
        return work

    @property
    def whole_rows(self) -> int:
        """The longest causal window a step always runs whole, as a running stream's step: never fewer than
        :data:`WHOLE_ROWS`, however small ``prefill_rows`` is (a 17-row verification window counted as a prompt when
        ``prefill_rows`` was 8, and waited, oldest prompt first, behind another request's whole prefill)."""
        return max(self.prefill_rows or 0, WHOLE_ROWS)

    def prefill_budget(self, window_rows: int) -> int:
        """Prompt rows a step takes beside ``window_rows`` rows of running windows: ``prefill_rows``, or, paced, as many
        as keep the step's cost on the batch's cost line within ``PREFILL_PACE`` times the windows' own step, their
        LM heads' step included (a prompt chunk has no head to run, so a pace of the layers alone would give the
        prompt less than its share).

        The line is never extrapolated: a paced step takes at most twice the prompt rows the recent steps took, and
        the line is fitted over steps up to that size. A line fitted on a few noisy steps may come out flat; a
        512-row chunk taken on its word would cost the streams seconds, and, beyond the fitted range, would never
        correct the line."""
        if self.prefill_rows is not None:
            return self.prefill_rows
        recent = list(itertools.islice(reversed(self.steps), 64))  # (not a copy of the whole history each step)
        cap = max(PREFILL_START, 2 * max((r.prefill_rows for r in recent if r.windows), default=0))
        curve = self.cost_curve((window_rows + cap) / 4, sizes=2)
        if curve is None:
            return PREFILL_START
        a, b = curve
        if b <= 0.0:
            return min(cap, PREFILL_CHUNK)  # rows look free: take more, and see
        heads = [r.seconds for r in recent if r.rows == 0]
        head = statistics.median(heads) if heads else 0.0
        rows = (PREFILL_PACE - 1.0) * (a + b * window_rows + head) / b
        return max(1, min(cap, PREFILL_CHUNK, int(rows + 1e-6)))  # (a fitted line's rounding must not cost a row)

    def _step(self, work: list[tuple[_Waiting, int]]) -> StepRecord:
        """One forward per (model, layer range) and one head product per model, outside the lock, one model's after
        another, each model's rows and wall recorded apart (:class:`ModelWork`)."""
        began = time.perf_counter()
        groups: dict[tuple, list[tuple[_Waiting, int]]] = {}
        for w, rows in sorted(work, key=lambda item: id(item[0].model)):  # (stable: each model's in arrival order)
            key = (id(w.model), w.start, w.end) if w.call is not None else (id(w.model), "head", id(w.head))
            groups.setdefault(key, []).append((w, rows))
        models = {model_key(w.model): w.model for w, _ in work}
        apart = len(models) > 1 and isinstance(self.budget, Goodput)  # a GPU model's own wall needs a sync (only
        # the goodput rule reads it)
        per_model: dict[int, list] = {}  # id -> [rows, prefill rows, seconds]
        windows = prompts = 0
        with batched_by(None), torch.inference_mode():
            for members in groups.values():
                model = members[0][0].model
                mine = per_model.setdefault(model_key(model), [0, 0, 0.0])
                start = time.perf_counter()
                if members[0][0].call is not None:
                    prompts += sum(w.prompt for w, _ in members)
                    windows += sum(not w.prompt for w, _ in members)
                    mine[0] += sum(rows for _, rows in members)
                    mine[1] += sum(rows for w, rows in members if w.prompt)
                self._run_group(members)
                if apart:
                    self._synchronize([model], work)
                mine[2] += time.perf_counter() - start
        self._synchronize(models.values(), work)
        seconds = time.perf_counter() - began
        parts = tuple(ModelWork(m, rows, prefill, seconds if len(models) == 1 else s)
                      for m, (rows, prefill, s) in per_model.items())
        return StepRecord(began, windows, prompts, sum(m.rows for m in parts), sum(m.prefill_rows for m in parts),
                          seconds, parts)

    @staticmethod
    def _synchronize(models: Iterable[Transformer], work: list[tuple[_Waiting, int]]) -> None:
        """Waits for the models' GPU work: a GPU runs behind the host, and the cost lines read its work's wall."""
        for device in {m.device for m in models if m.device.type == "cuda"}:
            try:
                torch.cuda.synchronize(device)
            except Exception as e:  # an asynchronous CUDA error: every member of the step gets it, the engine goes on
                for w, _ in work:
                    w.error, w.computed = e, True

    def _run_group(self, members: list[tuple[_Waiting, int]]) -> None:
        """One forward (or head product) for ``members``. If it fails, each member runs alone, as it would outside the
        batch (the same bits), so the member whose window is at fault gets its error on its own thread and the others
        their results: a request must not fail because of whom it shared a forward with. Nothing a failed call ran
        counts (a window's outputs and cache length move only once its call returns)."""
        run = self._layers if members[0][0].call is not None else self._heads
        try:
            run(members)
        except Exception as e:
            if len(members) == 1:
                members[0][0].error, members[0][0].computed = e, True
                return
            for member in members:
                try:
                    run([member])
                except Exception as own:
                    member[0].error, member[0].computed = own, True

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
                w.outputs, w.computed = [], True

    @staticmethod
    def _heads(members: list[tuple[_Waiting, int]]) -> None:
        model, head = members[0][0].model, members[0][0].head
        hidden = [w.hidden for w, _ in members]
        logits = model.logits(torch.cat(hidden, 1), head)  # row-local (execution.head_batchable): each row's own bits
        for (w, _), out in zip(members, logits.split([h.shape[1] for h in hidden], 1), strict=True):
            w.result, w.computed = out, True
