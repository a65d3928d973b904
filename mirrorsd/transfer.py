"""Host <-> device copies that keep a GPU's queue running: on a GPU a plain copy from pageable host memory, and every
read of a value, waits for all the work queued before it (a host sync), so a step that makes one in the middle
stalls the device until the host queues more."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def send(values: torch.Tensor | Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Host values (a tensor, or ints as int64) on ``device``. To a GPU through pinned memory and an asynchronous
    copy, which the caching host allocator keeps alive until the copy is done."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def read_soon(values: torch.Tensor) -> Callable[[], list]:
    """``values.tolist`` that waits for the device work queued before this call, not for what is queued after it."""
    if not values.is_cuda:
        return values.tolist
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(values.device))  # the copy's stream: the values' device, not the current one

    def read() -> list:
        ready.synchronize()
        return host.tolist()

    return read


def read_all(*tensors: torch.Tensor) -> list[list]:
    """Each tensor's ``tolist()``, from one copy to the host: one wait for the device's queue where a read each would
    wait once per tensor. The values travel as float64, so ints below 2**53 (token ids) and fp32 values come back
    exactly."""
    if not tensors:
        return []
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1).to(device=device, dtype=torch.float64) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        part, at = flat[at:at + t.numel()], at + t.numel()
        if t.dtype == torch.bool:
            part = [bool(v) for v in part]
        elif not t.is_floating_point():
            part = [int(v) for v in part]
        out.append(part[0] if t.dim() == 0 else _nested(part, list(t.shape)))
    return out


def _nested(flat: list, shape: list[int]) -> list:
    """``flat`` in ``shape``, as ``tolist`` nests it."""
    if len(shape) <= 1:
        return flat
    size = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * size:(i + 1) * size], shape[1:]) for i in range(shape[0])]
