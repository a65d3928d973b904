"""Mirror-SD with ``--backend processes``: the draft rank in its own process, the token channel between them.

The target's process drives :class:`RemoteDraft`, the :class:`~.draft.DraftSide` that forwards each call as one
fused int64 message. The draft's process runs :func:`serve_draft`, which holds a
:class:`~.draft.LocalDraft`, the draft's KV cache and a replica of the committed text. The target's process remains
the only source of committed tokens: every message carries the tokens committed since the last one. Per step:

* ``LAUNCH`` at the early exit: the new tokens, the window, the roots and the rollout depth. No reply is awaited,
  and the draft process rolls out while the target runs its upper layers.
* ``VERDICT`` at the final rendezvous: the new tokens (accepted length and correction). The reply says hit or miss
  and, on a hit, carries the kept branch (the next window), with the rollout's timestamps.
* ``FRESH`` after a miss: a fresh rollout, answered with its window.

With ``candidates="draft"`` each window sent back also carries the draft's likeliest tokens at its positions
(:func:`pack_window`), from which the target's process draws the next step's candidates.

Every wait has the ``channel_timeout``. If the draft process dies, hangs or errors, it is killed, the request goes
on with the target alone (``stats.extra["mirror"].draft_failed`` says why), and no verified token is lost or
repeated. The channel carries token ids only, so acceptance is ``match`` (greedy, or sample-and-match with the
request's seed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ... import kernels
from ...model import Transformer
from ...runtime import Executor, Span
from ...runtime.processes import (
    SHUTDOWN,
    Channel,
    ChannelError,
    LaunchedPeer,
    Worker,
    decode_text,
    encode_text,
    now_ns,
)
from ...runtime.tensor_parallel import RelayedChannel, SyncCount, current_world, launched_world, leave_world
from ...sampling import SamplingParams
from ...verify import Verdict
from ..engine import DecodeRequest, GenerationStats, Proposal, RequestState
from ..proposers import ModelProposer
from .draft import LocalDraft, fresh_proposer
from .options import MirrorOptions
from .stats import MirrorRun

START, FRESH, LAUNCH, VERDICT, END = 1, 2, 3, 4, 5  # message kinds (SHUTDOWN, 0, ends the worker)
NO_TREE = -1  # VERDICT reply: no rollout was launched this step
T = TypeVar("T")


def pack_window(draft: Proposal) -> list[int]:
    """A window for the channel: its tokens, then the draft's likeliest tokens per position (``candidates="draft"``;
    a width of 0 when it has none)."""
    alternatives = draft.alternatives or []
    width = len(alternatives[0]) if alternatives else 0
    return [len(draft.tokens), *draft.tokens, width, *(v for row in alternatives for v in row)]


def unpack_window(data: list[int]) -> tuple[list[int], list[list[int]] | None, list[int]]:
    """:func:`pack_window`'s inverse: the tokens, the per-position likeliest tokens (or None) and what follows."""
    n = data[0]
    tokens, width = data[1 : 1 + n], data[1 + n]
    flat, rest = data[2 + n : 2 + n + n * width], data[2 + n + n * width :]
    alternatives = [flat[i * width : (i + 1) * width] for i in range(n)] if width else None
    return tokens, alternatives, rest


# -- the draft's process ------------------------------------------------------------------------------------


class _Session:
    """One request on the draft rank: the draft model's side (:class:`~.draft.LocalDraft`) over a replica of the
    committed text."""

    def __init__(self, draft: Transformer, config: dict[str, Any], syncs: SyncCount | None = None) -> None:
        sampling = SamplingParams(**config["sampling"])
        opts = MirrorOptions(**config["options"])
        prompt = config["prompt"]
        req = DecodeRequest(target=None, prompt_ids=prompt, max_new_tokens=config["max_new_tokens"],  # type: ignore[arg-type]
                            sampling=sampling, stats=GenerationStats("mirror"), draft=draft, options=opts)
        run = MirrorRun(req, opts, exit_layer=0, executor=Executor())
        self.draft = LocalDraft(run, fresh_proposer(draft, config["target_vocab"], sampling, opts))
        capacity = len(prompt) + req.max_new_tokens + 2
        self.state = RequestState(req, list(prompt), None, draft.new_cache(capacity=capacity),  # type: ignore[arg-type]
                                  list(prompt))
        self.prompt_len = len(prompt)
        self.tree: Any = None
        self.launch_recv = 0
        self.syncs = syncs  # a sharded draft's all-reduces
        self.tree_syncs: list[int] = [0, 0, 0]

    def counted(self, work: Callable[[], T]) -> tuple[T, list[int]]:
        """``work()``, and the all-reduces it made: [count, microseconds, elements] (zeros for a draft in one
        process)."""
        if self.syncs is None:
            return work(), [0, 0, 0]
        before = dataclasses.replace(self.syncs)
        result = work()
        made = self.syncs.since(before)
        return result, [made.count, round(made.seconds * 1e6), made.elements]

    def sync(self, data: list[int]) -> list[int]:
        """Append the tokens the target committed since the last message; return the rest of the payload."""
        count = data[0]
        self.state.tokens.extend(data[1 : 1 + count])
        self.state.produced = len(self.state.tokens) - self.prompt_len
        return data[1 + count :]

    def fresh(self, data: list[int]) -> list[int]:
        self.sync(data)
        start = now_ns()
        proposer = self.draft.proposer
        window, syncs = self.counted(lambda: proposer.settled(self.state, proposer.propose(self.state)))
        return [*pack_window(window), window.forwards, *syncs, start, now_ns()]

    def launch(self, data: list[int], received: int) -> None:
        rest = self.sync(data)
        n_window = rest[0]
        window, rest = rest[1 : 1 + n_window], rest[1 + n_window :]
        n_roots = rest[0]
        flat = rest[1 : 1 + 2 * n_roots]
        roots, steps = [(flat[2 * i], flat[2 * i + 1]) for i in range(n_roots)], rest[1 + 2 * n_roots]
        state = self.state
        spine = [*state.tokens, *window][len(state.draft_cache):]
        self.launch_recv = received
        self.tree, self.tree_syncs = self.counted(
            lambda: self.draft.rollout(len(state.tokens), len(window), spine, roots, steps, state))

    def verdict(self, data: list[int], received: int) -> list[int]:
        accepted, correction = self.sync(data)
        tree, self.tree = self.tree, None
        state = self.state
        if tree is None:
            ModelProposer.rollback(state, accepted)
            return [NO_TREE, *pack_window(Proposal()), 0, 0, 0, 0, 0, 0, 0, 0, received]
        start = now_ns()
        branch = tree.branch(accepted, correction)
        kept = Proposal()
        if branch is not None:
            kept = self.draft.keep_branch(state, tree, branch)
        else:
            ModelProposer.rollback(state, accepted)
        select = now_ns() - start
        span = tree.span
        return [int(branch is not None), *pack_window(kept), tree.forwards, *self.tree_syncs, int(span.start * 1e9),
                int(span.end * 1e9), select, self.launch_recv, received]


def serve_draft(channel: Any, draft: Transformer, syncs: SyncCount | None = None) -> None:
    """The draft rank's loop: one request at a time until the caller says stop (or its end of the group closes).
    A draft sharded over several ranks (``--draft-tp``) runs it on each of them over a relayed channel; ``syncs``
    counts that draft's all-reduces."""
    kernels.available()  # a quantized draft needs this process to load the CPU kernels too
    session: _Session | None = None
    # START and LAUNCH get no reply: an error in one waits for the caller's next receive (sent while the caller
    # sends, both sides would block in gloo until its timeout, and the message would be lost)
    pending: Exception | None = None
    with torch.inference_mode():
        while True:
            try:
                kind, data = channel.recv()
            except ChannelError:
                return  # the caller is gone
            received = now_ns()
            if kind == SHUTDOWN:
                return
            try:
                payload = data.tolist()
                if kind == START:
                    pending = None
                    session = _Session(draft, json.loads(decode_text(data)), syncs)
                elif kind == END:
                    session = pending = None
                elif pending is not None and kind in (FRESH, VERDICT):
                    error, pending = pending, None
                    raise error
                elif session is None:
                    raise RuntimeError(f"message {kind} outside a request")
                elif kind == FRESH:
                    channel.send(FRESH, session.fresh(payload))
                elif kind == LAUNCH:
                    session.launch(payload, received)
                elif kind == VERDICT:
                    channel.send(VERDICT, session.verdict(payload, received))
            except Exception as error:  # noqa: BLE001 - reported to the target, which goes on alone
                session = None
                if kind in (START, LAUNCH):
                    pending = pending or error  # (the first: a LAUNCH after a failed START says only "outside")
                    continue
                try:
                    channel.send_error(error)
                except ChannelError:
                    return  # the caller is gone: nobody to tell



# -- the target's process ------------------------------------------------------------------------------------

_workers: dict[tuple[int, int | None], Worker | LaunchedPeer] = {}
_served: dict[tuple[int, int | None], weakref.ref] = {}  # the draft each spawned worker holds a copy of
_claims = threading.Lock()  # guards _held and _spawning (never held while a rank spawns)
_held: set[int] = set()  # the draft ranks a request holds, START to END: a rank serves one session at a time
_spawning: dict[tuple[int, int | None], threading.Lock] = {}  # per draft key: one first request spawns its rank


def draft_worker(draft: Transformer, threads: int | None, tp: int = 1) -> Worker | LaunchedPeer:
    """The draft rank for this draft model: spawned on first use and kept for later requests, or, when this process
    joined a ``torchrun`` world for mirrorsd (``mirrorsd generate`` under torchrun, :func:`launched_world`), that
    world's draft rank (``serve_launched`` runs there). A caller's own torchrun world (data-parallel API calls, say)
    is not taken over: each rank spawns its own draft process. ``tp``: the target's tensor-parallel ranks; rank 0
    relays the channel to the others."""
    key = (0, None) if current_world() is not None else (id(draft), threads)
    with _claims:
        spawning = _spawning.setdefault(key, threading.Lock())
    with spawning:  # (two first requests at once spawned two ranks, one orphaned; other drafts' requests go on)
        return _draft_worker(draft, threads, tp, key)


def _draft_worker(draft: Transformer, threads: int | None, tp: int, key: tuple[int, int | None]
                  ) -> Worker | LaunchedPeer:
    if current_world() is not None:
        if key not in _workers:
            _workers[key] = LaunchedPeer(_launched_channel(tp))
        if not _workers[key].alive():
            raise ChannelError(f"the draft rank is unusable ({_workers[key].broken})")
        return _workers[key]
    if tp > 1:
        raise ChannelError("a tensor-parallel target needs its draft rank from torchrun (WORLD_SIZE = tp + 1)")
    worker = _workers.get(key)
    # a worker is this draft's only while that draft lives: a later model may get a collected one's id, and must
    # not draft with the old weights
    if worker is None or not worker.alive() or _served.get(key, lambda: None)() is not draft:
        if worker is not None:
            worker.close()
        worker = _workers[key] = Worker(serve_draft, (draft,), threads=threads)
        _served[key] = weakref.ref(draft)
        weakref.finalize(draft, _retire, key, worker)  # its process and shared weights go with the draft
    return worker


def _claim(worker: Worker | LaunchedPeer) -> bool:
    """Hold ``worker`` for one request; False where another request holds it (two sessions interleaved on one rank
    broke each other's drafting and got the rank killed)."""
    with _claims:
        if id(worker) in _held:
            return False
        _held.add(id(worker))
        return True


def _release(worker: Worker | LaunchedPeer) -> None:
    with _claims:
        _held.discard(id(worker))


def _retire(key: tuple[int, int | None], worker: Worker) -> None:
    """A draft was collected: stop the rank that held its copy (each new draft object spawned one more)."""
    if _workers.get(key) is worker:
        del _workers[key]
        _served.pop(key, None)
        _spawning.pop(key, None)
    worker.abandon("its draft model was collected")


def _launched_channel(tp: int) -> Channel | RelayedChannel:
    world = launched_world(tp)
    if world.draft_rank is None:
        raise ChannelError(f"--backend processes under torchrun needs a draft rank: WORLD_SIZE = {tp + 1} "
                           f"(--target-tp {tp} + 1, or + --draft-tp), got {world.world}")
    if world.rank == 0:
        channel = Channel(world.channel_group, 0)
        return RelayedChannel(world.tp_group, channel) if world.tp_group is not None else channel
    return RelayedChannel(world.tp_group)


def serve_launched(draft: Transformer, tp: int = 1, draft_tp: int = 1, syncs: SyncCount | None = None) -> None:
    """A draft rank of a ``torchrun`` world: serve the target's rank 0 until it says stop, then leave the world
    with the target's ranks (:func:`leave_launched_world`). With ``draft_tp`` > 1 the draft's first rank talks to
    the target and relays every message to the draft's other ranks, which run the same loop on them."""
    world = launched_world(tp, draft_tp)
    if world.draft_group is None:
        channel: Channel | RelayedChannel = Channel(world.channel_group, 1)
    elif world.rank == world.draft_rank:
        channel = RelayedChannel(world.draft_group, Channel(world.channel_group, 1))
    else:
        channel = RelayedChannel(world.draft_group)
    serve_draft(channel, draft, syncs)
    leave_launched_world()


def leave_launched_world(timeout: float = 60.0) -> None:
    """End this rank's part of a ``torchrun`` world (every rank calls it last): rank 0 tells the draft rank to
    stop, then all ranks meet and tear their groups down together. A rank that exits with its gloo groups up
    while a peer is already gone can abort ("terminate called without an active exception")."""
    world = current_world()
    if world is None:
        return
    peer = _workers.pop((0, None), None)
    healthy = peer is None or peer.alive()
    if world.rank == 0 and world.draft_rank is not None and healthy:
        with contextlib.suppress(ChannelError):  # a draft rank that already left: nothing to stop
            Channel(world.channel_group, 0, timeout).send(SHUTDOWN)
    leave_world(wait=healthy, timeout=timeout)


def close_workers() -> None:
    """Stop every draft rank this process spawned (they are also stopped at exit)."""
    while _workers:
        _workers.popitem()[1].close()
    _served.clear()


@dataclass
class _RemoteTree:
    """What MirrorRun.joined reads of a rollout: its span (the draft process's clock is this one) and forwards."""

    span: Span
    forwards: int
    graphed: bool = False  # (the draft rank's rollouts are issued step by step)

    def depth(self, steps: int) -> float:
        return steps  # (a branch's own count, where the rank's rollout was a graph, stays there)


class RemoteDraft:
    """The draft in another process (the module docstring): fresh rollouts, tree rollouts and branch selection go
    over the channel; :class:`~.draft.BranchProposer` keeps the window logic in this process."""

    def __init__(self, run: MirrorRun, req: DecodeRequest) -> None:
        self.run, self.req, self.opts = run, req, run.opts
        self.worker: Worker | LaunchedPeer | None = None
        self.synced = 0  # committed tokens the draft rank has been sent
        self.launched: int | None = None  # perf_counter_ns when this step's LAUNCH left, if one did
        self.channel_s: dict[str, list[float]] = run.stats.channel_s
        self.awaiting = False  # a FRESH or VERDICT went and its reply has not come: the rank is busy answering
        self.own = False  # the rank was spawned for this request alone (the shared one was busy): closed with it

    # -- the channel

    def _new_tokens(self, state: RequestState) -> list[int]:
        new = state.tokens[self.synced:]
        self.synced = len(state.tokens)
        return [len(new), *new]

    def _send(self, kind: int, payload: list[int]) -> None:
        assert self.worker is not None
        self.awaiting = kind in (FRESH, VERDICT)
        self.worker.channel.send(kind, payload)

    def _reply(self, kind: int) -> list[int]:
        assert self.worker is not None
        got, data = self.worker.channel.recv()
        self.awaiting = False
        if got != kind:
            raise ChannelError(f"expected reply {kind}, got {got}")
        return data.tolist()

    # -- the side

    def start(self, state: RequestState) -> None:
        opts, req = self.opts, self.req
        config = {"sampling": vars(req.sampling), "max_new_tokens": req.max_new_tokens, "prompt": state.tokens,
                  "target_vocab": req.target.config.vocab_size,
                  "options": {"gamma": opts.gamma, "confidence": opts.confidence, "draft_vocab": opts.draft_vocab,
                              "draft_streams": opts.draft_streams, "acceptance": opts.acceptance,
                              "kappa": opts.kappa, "candidates": opts.candidates}}
        threads = self.run.executor.draft_threads
        worker = draft_worker(req.draft, threads, getattr(req.target, "tp_size", 1))
        if not _claim(worker):  # another request holds that rank (an API thread; a stream not yet read to its end)
            if isinstance(worker, LaunchedPeer):
                raise ChannelError("the torchrun world's draft rank is serving another request (one at a time)")
            worker, self.own = Worker(serve_draft, (req.draft,), threads=threads), True  # its own, for this request
            _claim(worker)
        self.worker = worker
        self.worker.channel.timeout = opts.channel_timeout
        self._send(START, encode_text(json.dumps(config)))
        self.synced = len(state.tokens)

    def fresh(self, state: RequestState) -> Proposal:
        self._send(FRESH, self._new_tokens(state))
        tokens, alternatives, (forwards, syncs, sync_us, elements, begin, end) = unpack_window(self._reply(FRESH))
        self.run.synced("fresh", syncs, sync_us, elements)
        self.run.tracer.spans.append(Span("draft", "fresh rollout", begin / 1e9, end / 1e9,
                                          {"all_reduces": syncs} if syncs else {}))
        return Proposal(tokens, forwards=forwards, alternatives=alternatives)

    def launch(self, state: RequestState, window: Proposal, roots: Sequence[tuple[int, int]], steps: int) -> None:
        self.launched = now_ns()
        self._send(LAUNCH, [*self._new_tokens(state), window.length, *window.tokens, len(roots),
                            *(x for root in roots for x in root), steps])

    def verdict(self, state: RequestState, verdict: Verdict) -> Proposal | None:
        """The verdict goes over; the kept branch (or a miss) comes back. The draft process rolls its own cache
        back."""
        launched, self.launched = self.launched, None
        sent = now_ns()
        self._send(VERDICT, [*self._new_tokens(state), verdict.accepted, verdict.next_token])
        reply = self._reply(VERDICT)
        hit = reply[0]
        tokens, alternatives, (forwards, syncs, sync_us, elements, begin, end, select, launch_recv, verdict_recv) = \
            unpack_window(reply[1:])
        # The draft process reads the verdict once its rollout is done: the channel's own part starts then.
        self.channel_s.setdefault("final", []).append((verdict_recv - max(sent, end)) / 1e9)
        if hit == NO_TREE:
            self.run.joined(None)
            return None
        if launched is not None:
            self.channel_s.setdefault("early_exit", []).append((launch_recv - launched) / 1e9)
        span = Span("draft", "rollout", begin / 1e9, end / 1e9, {"all_reduces": syncs} if syncs else {})
        self.run.tracer.spans.append(span)
        self.run.synced("rollout", syncs, sync_us, elements)
        state.stats.draft_forwards += forwards
        self.run.joined(_RemoteTree(span, forwards))
        self.run.selected(select / 1e9, bool(hit))
        return Proposal(tokens, alternatives=alternatives) if hit else None

    def abandon(self, error: BaseException) -> BaseException:
        if self.worker is None:
            return error
        # A dead rank is named as one: gloo may report a dead peer as a closed connection or, when the send went
        # into the socket buffer first, as a timed-out receive, which alone would read like a hang.
        process = getattr(self.worker, "process", None)  # (a torchrun world's draft rank is the launcher's)
        code = process.exitcode if process is not None else None
        error = error if code is None else ChannelError(f"the draft rank exited with code {code}: {error}")
        self.worker.abandon(f"{type(error).__name__}: {error}")
        return error

    def close(self, failed: bool) -> None:
        """The request is over: the draft rank drops its session and waits for the next one. Stopped between a
        request and its reply (a Ctrl-C), the rank is sending that reply: an END sent into it would wait for the
        channel's timeout, so the rank is given up at once (the next request spawns another)."""
        if self.worker is None:
            return
        if self.awaiting and not failed:
            self.worker.abandon("stopped while the draft rank was answering")
        elif not failed:
            try:
                self._send(END, [])
            except ChannelError as error:
                self.worker.abandon(str(error))
        _release(self.worker)
        if self.own:
            self.worker.close()
