"""Building an execution backend by name (:data:`~mirrorsd.runtime.executors.BACKENDS`): the one place that knows
every placement, the in-process executors and the processes backend alike."""

from __future__ import annotations

import os

import torch

from .executors import BACKENDS, Executor, InlineStreamExecutor, WorkerExecutor, split_threads
from .processes import ProcessesExecutor


def make_executor(backend: str, target_device: torch.device, draft_device: torch.device,
                  split: tuple[int, int] | None = None, graphs: bool = False, inline: bool = False) -> Executor:
    """Check that ``backend`` fits the models' devices and build it (``split``: threads for target, draft;
    ``graphs``: CUDA graphs stay on while the draft overlaps the target, on ``cuda-streams`` and ``devices``;
    ``inline``: ``cuda-streams`` issued from the caller's thread, :class:`InlineStreamExecutor`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    same = target_device == draft_device
    if backend == "serial":
        return Executor()
    if backend == "threads":
        if target_device.type != "cpu" or not same:
            raise ValueError("backend 'threads' runs target and draft on the same CPU; "
                             "use 'cuda-streams' on one GPU or 'devices' for two devices")
        total = torch.get_num_threads() if split is None else sum(split)
        target_threads, draft_threads = split or split_threads(total) or (1, 1)
        if total > (os.cpu_count() or total):
            raise ValueError(f"thread split {target_threads}+{draft_threads} exceeds the {os.cpu_count()} cores")
        return WorkerExecutor("threads", draft_device, draft_threads, target_threads)
    if backend == "processes":
        return ProcessesExecutor(split)
    if backend == "cuda-streams":
        if target_device.type != "cuda" or not same:
            raise ValueError("backend 'cuda-streams' needs target and draft on the same CUDA device")
        return InlineStreamExecutor(draft_device) if inline else \
            WorkerExecutor("cuda-streams", draft_device, None, None, graphs)
    if same:
        raise ValueError(f"backend 'devices' needs the draft on another device than the target ({target_device}); "
                         "set --draft-device")
    return WorkerExecutor("devices", draft_device, split[1] if split else None, split[0] if split else None, graphs)
