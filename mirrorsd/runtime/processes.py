"""The ``processes`` backend's transport: the draft in its own OS process, joined to the caller by a dedicated
two-rank gloo process group (torch.distributed) that carries the token channel.

Spawned by mirrorsd (one machine), the group is built directly on a ``TCPStore`` rather than through
``init_process_group``, so it never touches the caller's default group (a user of torch.distributed keeps theirs).
Started by ``torchrun`` (rank 0 the target, the last rank the draft, on one machine or several), the ranks join the
launcher's world and the channel is a ``new_group`` of the two (:func:`~.tensor_parallel.launched_world`, which
also groups the target's ranks under ``--target-tp``). Messages are fused int64 tensors: a
two-element header (kind, length) and the payload. Every receive on the caller's side has a timeout, and a worker
that dies, hangs or errors is killed and reported, never waited on forever.

Both processes time with ``time.perf_counter`` (``CLOCK_MONOTONIC`` on Linux, one clock for the whole machine),
so spans recorded by the draft process line up with the caller's in a trace.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import signal
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .executors import Executor, ThreadCount, split_threads

SHUTDOWN = 0  # message kind that ends a worker's loop
ERROR = -1  # reply kind: the payload is the worker's error message (UTF-8 bytes)
_JOINED = "mirrorsd-worker-joined"  # the store key a worker sets once it is up
_MAIN_GUARD = ("a script that starts backend='processes' at import time: the draft process is spawned and imports "
               "the script's main module again, so start it under `if __name__ == \"__main__\":`")


class ChannelError(RuntimeError):
    """The other process timed out, died or reported an error."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(rank: int, port: int, setup_timeout: float, peer: mp.Process | None = None) -> dist.ProcessGroup:
    """The two-rank group. Its own timeout is long (a worker waits idle between requests); the caller bounds
    every receive with its own timeout instead. Rank 0 watches ``peer`` while it waits for it to join, so a
    worker that dies starting up is reported at once, not after ``setup_timeout``."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=setup_timeout),
                          wait_for_workers=False)
    if rank == 1:
        store.set(_JOINED, "1")
    else:
        _await_join(store, peer, setup_timeout)
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(days=1))


def _await_join(store: dist.TCPStore, peer: mp.Process | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not store.check([_JOINED]):
        if peer is not None and not peer.is_alive():
            raise ChannelError(
                f"the draft process exited (code {peer.exitcode}) before it connected; its error is printed above. "
                f"The usual cause: {_MAIN_GUARD}")
        if time.monotonic() > deadline:
            raise ChannelError(f"the draft process did not connect within {timeout:.0f} s")
        time.sleep(0.02)


class Channel:
    """One end of the two-rank group: send and receive (kind, int64 payload) messages. ``timeout`` bounds every
    wait (None: wait as long as it takes, as the idle draft rank does)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, timeout: float | None = None) -> None:
        self.group, self.rank, self.peer, self.timeout = group, rank, 1 - rank, timeout

    def send(self, kind: int, payload: list[int] | torch.Tensor = ()) -> None:
        data = torch.as_tensor(payload, dtype=torch.long).reshape(-1)
        wait_for(lambda: self.group.send([torch.tensor([kind, data.numel()])], self.peer, 0), self.timeout)
        if data.numel():
            wait_for(lambda: self.group.send([data], self.peer, 1), self.timeout)

    def recv(self, timeout: float | None = None) -> tuple[int, torch.Tensor]:
        """The next message, waiting ``timeout`` seconds at most (default: the channel's)."""
        timeout = self.timeout if timeout is None else timeout
        header = torch.empty(2, dtype=torch.long)
        wait_for(lambda: self.group.recv([header], self.peer, 0), timeout)
        kind, length = int(header[0]), int(header[1])
        data = torch.empty(length, dtype=torch.long)
        if length:
            wait_for(lambda: self.group.recv([data], self.peer, 1), timeout)
        if kind == ERROR:
            raise ChannelError(f"the other process failed: {decode_text(data)}")
        return kind, data

    def send_error(self, error: BaseException) -> None:
        self.send(ERROR, encode_text(f"{type(error).__name__}: {error}"))


def wait_for(start: Callable[[], Any], timeout: float | None) -> None:
    """Start a gloo send, receive or broadcast and wait for it, at most ``timeout`` seconds (None: as long as it
    takes); a timeout or a closed connection, which gloo raises from either call, becomes a :class:`ChannelError`."""
    try:
        work = start()
        if timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as error:  # gloo: a timeout, or the peer's connection closed
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ChannelError(f"the channel to the other process failed ({reason[:200]})") from None


def encode_text(text: str) -> list[int]:
    return list(text.encode())


def decode_text(data: torch.Tensor) -> str:
    return bytes(data.tolist()).decode(errors="replace")


def _child(port: int, timeout: float, threads: int | None, entry: Callable[..., None], inbox: Any) -> None:
    # The caller decides when this process ends (a closed channel ends it too): a terminal's Ctrl-C reaches the
    # whole process group, and would print this process's traceback beside the caller's quiet exit
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    channel = Channel(_group(1, port, timeout), 1)
    entry(channel, *inbox.get())


class Worker:
    """A spawned process running ``entry(channel, *args)``; the caller holds the other end of the channel.
    ``args`` cross by pickling (CPU tensors of a model go through shared memory, not copies), through a queue once
    the process has joined: a model's pickle (~10 MB for the 0.5B) in the spawn payload itself would block
    ``start()`` until the child read it, and forever if the child died first."""

    def __init__(self, entry: Callable[..., None], args: tuple, threads: int | None = None,
                 setup_timeout: float = 120.0) -> None:
        if getattr(mp.current_process(), "_inheriting", False):
            # We are a draft process of ours, importing the caller's main module: its script starts this backend
            # at import time. Stop now, before that script's work runs a second time in this process; the caller
            # sees this process exit and says why.
            raise SystemExit(f"mirrorsd: a draft process was asked for another draft process while it imported "
                             f"the main module. The cause: {_MAIN_GUARD}")
        port = free_port()
        context = mp.get_context("spawn")
        inbox = context.Queue()
        inbox.cancel_join_thread()  # a worker that dies before reading must not hold up this process's exit
        self.process = context.Process(target=_child, args=(port, setup_timeout, threads, entry, inbox),
                                       daemon=True, name="mirrorsd-draft-rank")
        self.process.start()
        try:
            self.channel = Channel(_group(0, port, setup_timeout, self.process), 0)
        except ChannelError:
            self.process.kill()
            raise
        inbox.put(args)
        self.broken: str | None = None
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.broken is None and self.process.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the worker to stop; kill it if it does not within ``timeout`` (a hung or broken one)."""
        if self.process.is_alive() and self.broken is None:
            with contextlib.suppress(Exception):  # a broken channel: fall through to the kill
                self.channel.send(SHUTDOWN)
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        atexit.unregister(self.close)

    def abandon(self, why: str) -> None:
        """The channel cannot be trusted any more (a timeout, a death, an error): kill the worker now."""
        self.broken = why
        self.close(timeout=1.0)


def launched_rank() -> int | None:
    """This process's rank when a launcher (``torchrun``) started a world of several processes, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


class LaunchedPeer:
    """The draft rank of a ``torchrun`` world, seen from rank 0: :class:`Worker`'s interface, but the process
    is the launcher's to start and stop (a broken one is only stopped being used)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.broken: str | None = None

    def alive(self) -> bool:
        return self.broken is None

    def close(self, timeout: float = 5.0) -> None:
        if self.broken is None:
            with contextlib.suppress(Exception):
                self.channel.send(SHUTDOWN)
            self.broken = "closed"

    def abandon(self, why: str) -> None:
        self.broken = why


class ProcessesExecutor(Executor):
    """The ``processes`` backend as seen by the calling process: the draft's work runs in the worker (the method
    talks to it through its channel); here only the thread split applies while the two overlap."""

    name = "processes"

    def __init__(self, split: tuple[int, int] | None = None) -> None:
        self.total_threads = torch.get_num_threads()
        self.split = split or split_threads(self.total_threads)

    @property
    def draft_threads(self) -> int | None:
        return self.split[1] if self.split else None

    def overlapping(self) -> AbstractContextManager[None]:
        return ThreadCount(self.split[0], self.total_threads) if self.split else nullcontext()


def now_ns() -> int:
    return time.perf_counter_ns()
