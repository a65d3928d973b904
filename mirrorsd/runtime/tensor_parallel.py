"""Target tensor parallelism (``--target-tp N``): the target's projections sharded over N ranks with DTensor.

The Megatron layout the Mirror-SD paper assumes for its target: in every block the q/k/v and gate/up projections
are split by output feature (``ColwiseParallel``: each rank holds ``n_heads / N`` query heads, ``n_kv_heads / N``
key/value heads and its slice of the MLP), and o_proj and down_proj by input feature (``RowwiseParallel``: partial
sums, all-reduced). Embeddings, norms and the LM head stay whole, so every rank ends a forward with the same
hidden states and logits, and the early exit reads them like an unsharded model's. Each rank's KV cache holds its
own heads only.

All N ranks run the same decoding loop (SPMD): the same inputs and seeded noise give them the same verdicts, so
they issue the same collectives in the same order. Rank 0 alone talks to a draft rank; it relays what it
receives to the others (:class:`RelayedChannel`). Lossless here means equal to the sharded target's own ``ar``:
sharding changes the summation order of o_proj and down_proj, so its logits may differ from the unsharded
model's in the last bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..linear import DenseLinear
from .processes import ERROR, ChannelError, decode_text, encode_text, wait_for
from .trace import Span

COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
SENT = 0  # relayed after rank 0's send worked (an error is relayed as the channel's ERROR)


@dataclasses.dataclass
class LaunchedWorld:
    """The groups of a ``torchrun`` world: ranks ``0..tp-1`` hold the target, rank ``tp`` (if there is one) the
    draft. Created once per process, in the same order on every rank (``new_group`` is collective)."""

    tp: int
    rank: int
    world: int
    tp_group: Any = None  # the target's ranks (None when tp == 1)
    channel_group: Any = None  # rank 0 and the draft rank (None without a draft rank)
    owns_default_group: bool = True  # launched_world initialised torch.distributed (else the caller did)

    @property
    def draft_rank(self) -> int | None:
        return self.tp if self.world == self.tp + 1 else None


_world: LaunchedWorld | None = None


def launched_world(tp: int = 1) -> LaunchedWorld:
    """Join the launcher's world (gloo) and build its groups: ``WORLD_SIZE`` must be ``tp`` (target ranks only)
    or ``tp + 1`` (and a draft rank)."""
    global _world
    if _world is not None:
        if _world.tp != tp:
            raise ValueError(f"this process already joined a world with --target-tp {_world.tp}, not {tp}")
        return _world
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world not in (tp, tp + 1):
        raise ValueError(f"--target-tp {tp} takes {tp} ranks, or {tp + 1} with a draft rank "
                         f"(--backend processes); got WORLD_SIZE={world}")
    owns_default_group = not dist.is_initialized()
    if owns_default_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=1))
    long = datetime.timedelta(days=1)  # an idle draft rank waits between requests; receives bound their own waits
    tp_group = dist.new_group(list(range(tp)), backend="gloo", timeout=long) if tp > 1 else None
    channel_group = dist.new_group([0, tp], backend="gloo", timeout=long) if world == tp + 1 else None
    _world = LaunchedWorld(tp, dist.get_rank(), world, tp_group, channel_group, owns_default_group)
    return _world


def current_world() -> LaunchedWorld | None:
    """The world this process joined with :func:`launched_world`, if it did."""
    return _world


def leave_world(wait: bool = True, timeout: float = 60.0) -> None:
    """Tear down the groups :func:`launched_world` made, after every rank got here when ``wait`` (at most
    ``timeout`` seconds; a rank that never comes is not waited for longer). The caller's own default group stays."""
    global _world
    if _world is None:
        return
    if wait:
        with contextlib.suppress(RuntimeError):  # a rank that is gone: leave anyway
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout))
    if _world.owns_default_group:
        dist.destroy_process_group()
    else:
        for group in (_world.tp_group, _world.channel_group):
            if group is not None:
                dist.destroy_process_group(group)
    _world = None


def shard_target(model: nn.Module, group: Any) -> nn.Module:
    """Shard ``model``'s (a :class:`~mirrorsd.model.Transformer` with dense weights) projections over
    ``group`` in place and give its attention and cache the local head counts; returns it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    size = dist.get_world_size(group)
    cfg = model.config
    if cfg.n_heads % size or cfg.n_kv_heads % size or cfg.intermediate_size % size:
        raise ValueError(f"--target-tp {size} must divide the target's {cfg.n_heads} attention heads, "
                         f"{cfg.n_kv_heads} key/value heads and {cfg.intermediate_size} MLP features")
    mesh = DeviceMesh.from_group(group, model.device.type)
    plan = {**{name: ColwiseParallel() for name in COLUMNWISE}, **{name: RowwiseParallel() for name in ROWWISE}}
    for block in model.layers:
        for name in (*COLUMNWISE, *ROWWISE):
            _as_nn_linear(block, name)
        parallelize_module(block, mesh, plan)
        block.self_attn.n_heads //= size
        block.self_attn.n_kv_heads //= size
    model.config = dataclasses.replace(cfg, n_heads=cfg.n_heads // size, n_kv_heads=cfg.n_kv_heads // size)
    model.tp_size = size
    return model


def gather_spans(spans: list[Span], world: LaunchedWorld) -> list[Span]:
    """Every target rank's spans on rank 0, one lane per rank (``target rank r``; the draft's spans, which each
    target rank holds from the relayed replies, once as ``draft rank N``); other ranks get ``[]``. Collective over
    the target's group."""
    own = [s for s in spans if s.lane == "target"]
    gathered: list[list[Span]] | None = [[] for _ in range(world.tp)] if world.rank == 0 else None
    dist.gather_object(own, gathered, group_dst=0, group=world.tp_group)
    if gathered is None:
        return []
    draft = f"draft rank {world.draft_rank}"
    merged = [dataclasses.replace(s, lane=f"target rank {r}") for r, ranked in enumerate(gathered) for s in ranked]
    return merged + [dataclasses.replace(s, lane=draft) for s in spans if s.lane != "target"]


def _as_nn_linear(block: nn.Module, name: str) -> None:
    """DTensor's parallel styles shard ``nn.Linear`` modules: swap a :class:`DenseLinear` for one (same
    tensors). Quantized and packed layers hold layouts DTensor cannot split."""
    parent_name, attr = name.split(".")
    parent = getattr(block, parent_name)
    layer = getattr(parent, attr)
    if not isinstance(layer, DenseLinear):
        raise ValueError(f"--target-tp shards dense weights; this target's {name} is a {type(layer).__name__} "
                         "(load it with weights='fp32' and linear='dense': --weights fp32 on the CLI)")
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                       device="meta", dtype=layer.weight.dtype)
    linear.weight = layer.weight
    if layer.bias is not None:
        linear.bias = layer.bias
    setattr(parent, attr, linear)


class RelayedChannel:
    """A target rank's view of the draft channel under tensor parallelism: rank 0 holds the real
    :class:`~.processes.Channel` and broadcasts every message it receives (or the failure it met) over the
    target's group; the other ranks send nothing and receive those broadcasts, so every rank runs the same
    proposer code on the same messages."""

    def __init__(self, group: Any, channel: Any = None, timeout: float | None = None) -> None:
        self.group, self.channel, self._timeout = group, channel, timeout

    @property
    def timeout(self) -> float | None:
        return self.channel.timeout if self.channel is not None else self._timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        if self.channel is not None:
            self.channel.timeout = value
        self._timeout = value

    def send(self, kind: int, payload: Any = ()) -> None:
        """Rank 0 sends and tells the others whether that worked (so a failed send fails every rank at the same
        point, and the group's collectives stay in step); the others only hear that."""
        if self.channel is None:
            self._follow(None)
            return
        try:
            self.channel.send(kind, payload)
        except ChannelError as error:
            self._relay(ERROR, torch.tensor(encode_text(str(error)), dtype=torch.long))
            raise
        self._relay(SENT, torch.empty(0, dtype=torch.long))

    def recv(self, timeout: float | None = None) -> tuple[int, torch.Tensor]:
        if self.channel is None:
            return self._follow(timeout)
        try:
            kind, data = self.channel.recv(timeout)
        except ChannelError as error:
            self._relay(ERROR, torch.tensor(encode_text(str(error)), dtype=torch.long))
            raise
        self._relay(kind, data)
        return kind, data

    def _relay(self, kind: int, data: torch.Tensor) -> None:
        header = torch.tensor([kind, data.numel()])
        dist.broadcast(header, group_src=0, group=self.group)
        if data.numel():
            dist.broadcast(data.contiguous(), group_src=0, group=self.group)

    def _follow(self, timeout: float | None) -> tuple[int, torch.Tensor]:
        timeout = self._timeout if timeout is None else timeout
        timeout = None if timeout is None else 2 * timeout + 10  # rank 0 relays only after its own wait ends
        header = torch.empty(2, dtype=torch.long)
        wait_for(lambda: dist.broadcast(header, group_src=0, group=self.group, async_op=True), timeout)
        kind, length = int(header[0]), int(header[1])
        data = torch.empty(length, dtype=torch.long)
        if length:
            wait_for(lambda: dist.broadcast(data, group_src=0, group=self.group, async_op=True), timeout)
        if kind == ERROR:
            raise ChannelError(decode_text(data))
        return kind, data
