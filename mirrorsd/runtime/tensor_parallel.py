"""Target tensor parallelism (``--target-tp N``): the target's projections sharded over N ranks.

The Megatron layout the Mirror-SD paper assumes for its target: in every block the q/k/v and gate/up projections
are split by output feature (column-parallel: each rank holds ``n_heads / N`` query heads, ``n_kv_heads / N``
key/value heads and its slice of the MLP), and o_proj and down_proj by input feature (row-parallel: partial sums,
all-reduced, then the bias once). Embeddings, norms and the LM head stay whole, so every rank ends a forward with
the same hidden states and logits, and the early exit reads them like an unsharded model's. Each rank's KV cache
holds its own heads only.

As in gpt-fast's ``tp.py`` and vLLM's parallel linears, the weights are sliced once and the sums are plain
``torch.distributed.all_reduce`` calls. DTensor's ``parallelize_module`` did the same arithmetic, but its per-call
sharding propagation cost more than the tiny projections themselves (see ``docs/mirror_sd.md``).

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
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..linear import DenseLinear
from .processes import ERROR, ChannelError, decode_text, encode_text, wait_for
from .trace import Span

COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
SENT = 0  # relayed after rank 0's send worked (an error is relayed as the channel's ERROR)


@dataclasses.dataclass
class LaunchedWorld:
    """The groups of a ``torchrun`` world: ranks ``0..tp-1`` hold the target, ranks ``tp..tp+draft_tp-1`` (if there
    are any) the draft. Created once per process, in the same order on every rank (``new_group`` is collective)."""

    tp: int
    rank: int
    world: int
    tp_group: Any = None  # the target's ranks (None when tp == 1)
    channel_group: Any = None  # rank 0 and the draft's first rank (None without a draft rank)
    owns_default_group: bool = True  # launched_world initialised torch.distributed (else the caller did)
    draft_tp: int = 1
    draft_group: Any = None  # the draft's ranks (None when draft_tp == 1)

    @property
    def draft_rank(self) -> int | None:
        """The draft's first rank: the one that talks to the target's rank 0."""
        return self.tp if self.world == self.tp + self.draft_tp else None

    @property
    def holds_draft(self) -> bool:
        return self.draft_rank is not None and self.rank >= self.tp


_world: LaunchedWorld | None = None


def launched_world(tp: int = 1, draft_tp: int | None = None) -> LaunchedWorld:
    """Join the launcher's world (gloo) and build its groups: ``WORLD_SIZE`` is ``tp`` (target ranks only) or
    ``tp + draft_tp`` (and the draft's ranks). ``draft_tp=None``: whatever the world leaves after the target's
    ranks (what a target rank knows)."""
    global _world
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if draft_tp is None:
        draft_tp = max(1, world - tp)
    if _world is not None:
        if (_world.tp, _world.draft_tp) != (tp, draft_tp):
            raise ValueError(f"this process already joined a world with --target-tp {_world.tp} and --draft-tp "
                             f"{_world.draft_tp}, not {tp} and {draft_tp}")
        return _world
    if world not in (tp, tp + draft_tp):
        raise ValueError(f"--target-tp {tp} takes {tp} ranks, or {tp + draft_tp} with the draft's "
                         f"(--backend processes, --draft-tp {draft_tp}); got WORLD_SIZE={world}")
    owns_default_group = not dist.is_initialized()
    if owns_default_group:
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=1))
    long = datetime.timedelta(days=1)  # an idle draft rank waits between requests; receives bound their own waits
    tp_group = dist.new_group(list(range(tp)), backend="gloo", timeout=long) if tp > 1 else None
    drafts = world == tp + draft_tp
    channel_group = dist.new_group([0, tp], backend="gloo", timeout=long) if drafts else None
    draft_group = (dist.new_group(list(range(tp, tp + draft_tp)), backend="gloo", timeout=long)
                   if drafts and draft_tp > 1 else None)
    _world = LaunchedWorld(tp, dist.get_rank(), world, tp_group, channel_group, owns_default_group, draft_tp,
                           draft_group)
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
        for group in (_world.tp_group, _world.channel_group, _world.draft_group):
            if group is not None:
                dist.destroy_process_group(group)
    _world = None


def shard_target(model: nn.Module, group: Any, partial: bool = False, count: SyncCount | None = None,
                 flag: str = "--target-tp") -> nn.Module:
    """Shard ``model``'s (a :class:`~mirrorsd.model.Transformer` with dense weights) projections over
    ``group`` in place and give its attention and cache the local head counts; returns it. ``partial``: o_proj and
    down_proj keep each rank's partial sum (no all-reduce; :func:`shard_draft`'s tracks). ``count`` records every
    all-reduce. ``flag``: the option a refusal names (the draft is sharded by the same code)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if getattr(model, "tp_size", 1) > 1:
        raise ValueError("this model is sharded already")
    cfg = model.config
    check_split(cfg, size)
    if model.embed_tokens.weight.device.type != "cpu":  # the fused CUDA layers read o_proj/down_proj's weights
        raise ValueError(f"{flag} shards a model on CPUs (gloo): on a GPU the fused layers would skip the "
                         "all-reduces, and each rank would decode from its own partial sums")
    for block in model.layers:  # every projection checked before any is split: a refusal leaves the model whole
        for name in (*COLUMNWISE, *ROWWISE):
            parent_name, attr = name.split(".")
            layer = getattr(getattr(block, parent_name), attr)
            if not isinstance(layer, DenseLinear):
                raise ValueError(f"--target-tp shards dense weights; this target's {name} is a "
                                 f"{type(layer).__name__} (load it with weights='fp32' and linear='dense': --weights "
                                 "fp32 on the CLI)")
    for block in model.layers:
        for name in (*COLUMNWISE, *ROWWISE):
            parent_name, attr = name.split(".")
            parent = getattr(block, parent_name)
            layer = getattr(parent, attr)
            if name in COLUMNWISE:
                bias = None if layer.bias is None else layer.bias.chunk(size)[rank].clone()
                setattr(parent, attr, DenseLinear(layer.weight.chunk(size)[rank].clone(), bias))
            elif partial and layer.bias is not None:
                raise ValueError(f"a track keeps {name}'s partial sum, which a bias would join once per rank")
            else:
                setattr(parent, attr, RowParallelLinear(layer.weight.chunk(size, 1)[rank].clone(), layer.bias,
                                                        None if partial else group, count))
        block.self_attn.n_heads //= size
        block.self_attn.n_kv_heads //= size
    model.config = dataclasses.replace(cfg, n_heads=cfg.n_heads // size, n_kv_heads=cfg.n_kv_heads // size)
    model.tp_size = size
    return model


class RowParallelLinear(DenseLinear):
    """o_proj or down_proj over a group: this rank's input features give a partial sum, all-reduced over ``group``
    (None: kept, a track's), then the bias, once. ``count`` records each all-reduce."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                 count: SyncCount | None = None) -> None:
        super().__init__(weight, bias)
        self.group, self.count = group, count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.group is not None:
            start = time.perf_counter()
            dist.all_reduce(out, group=self.group)
            if self.count is not None:
                self.count.add(time.perf_counter() - start, out.numel())
        return out if self.bias is None else out + self.bias


DRAFT_SYNCS = ("spd", "layer")  # --draft-syncs
SPD_SEGMENTS = 2  # the Mirror-SD paper's draft: two segments, two all-reduces per forward


@dataclasses.dataclass
class SyncCount:
    """The all-reduces a sharded draft made: how many, their time and their summed size in elements (what the
    latency law's T_allreduce(M; G) = α log G + β M is fitted to)."""

    count: int = 0
    seconds: float = 0.0
    elements: int = 0

    def add(self, seconds: float, elements: int) -> None:
        self.count += 1
        self.seconds += seconds
        self.elements += elements

    def since(self, before: SyncCount) -> SyncCount:
        return SyncCount(self.count - before.count, self.seconds - before.seconds, self.elements - before.elements)


def check_split(cfg: Any, size: int) -> None:
    """``size`` ranks (or tracks) must split a model's heads, key/value heads and MLP features evenly."""
    if cfg.n_heads % size or cfg.n_kv_heads % size or cfg.intermediate_size % size:
        raise ValueError(f"{size} ranks must divide the model's {cfg.n_heads} attention heads, "
                         f"{cfg.n_kv_heads} key/value heads and {cfg.intermediate_size} MLP features")


def segment_bounds(n_layers: int, segments: int = SPD_SEGMENTS) -> list[int]:
    """The first layer of each of the spd form's contiguous segments, then ``n_layers``: its all-reduces follow
    the layers just before each bound."""
    if not 1 <= segments <= n_layers:
        raise ValueError(f"segments must be in 1..{n_layers} (the draft's layers), got {segments}")
    return [round(i * n_layers / segments) for i in range(segments + 1)]


def shard_draft(model: nn.Module, group: Any, syncs: str = "spd", segments: int = SPD_SEGMENTS) -> SyncCount:
    """The draft over the ranks of ``group``, in place; returns the counter of its all-reduces.

    ``layer``: Megatron tensor parallelism as the target's (:func:`shard_target`): two all-reduces per layer, the
    draft's own function. ``spd``: the Mirror-SD paper's draft sharding (§3.3, after SPD, "sync-point drop", Kim et
    al. 2025): the layers form ``segments`` contiguous segments; inside one, each rank is a *track* that runs its
    heads and its slice of the MLP on a residual stream of its own, with no traffic (o_proj and down_proj keep their
    partial sums); at the segment's end one all-reduce adds every track's update to the segment's input. Two
    segments: two all-reduces per draft forward instead of 2·N. The paper trains its drafts in this form; a draft
    trained whole computes something else once its syncs are dropped, so its proposals change. The target verifies
    them, so the output cannot."""
    if syncs not in DRAFT_SYNCS:
        raise ValueError(f"draft syncs must be one of {', '.join(DRAFT_SYNCS)}, got {syncs!r}")
    bounds = segment_bounds(model.config.n_layers, segments)
    count = SyncCount()
    partial = syncs == "spd"
    shard_target(model, group, partial=partial, count=count, flag="--draft-tp")
    if not partial:
        return count
    for first, last in zip(bounds, bounds[1:], strict=False):
        held: dict[str, torch.Tensor] = {}
        model.layers[first].register_forward_pre_hook(lambda _m, args, held=held: held.update(x=args[0]))
        model.layers[last - 1].register_forward_hook(segment_sync(held, group, count))
    return count


def run_tracks(model: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, start: int, end: int,
               tracks: int, segments: int = SPD_SEGMENTS) -> torch.Tensor:
    """Blocks ``[start, end)`` of a whole model, in one process, as :func:`shard_draft`'s spd form computes them
    over ``tracks`` ranks (causal over the window, no cache): differentiable, so a draft can be trained in the form
    it will run in, as the paper trains its drafts. Inside a segment each track runs every layer on a residual
    stream of its own with only its key/value heads' values and its slice of MLP features (the rest masked to
    zero: what a rank that does not hold them adds); the segment's end adds every track's update to its input.
    ``start`` and ``end`` must be segment bounds, where the tracks agree."""
    check_split(model.config, tracks)
    bounds = segment_bounds(model.config.n_layers, segments)
    if start not in bounds or end not in bounds:
        raise ValueError(f"the spd form's tracks re-align only at layers {bounds}: got layers {start}..{end}")
    for first, last in zip(bounds, bounds[1:], strict=False):
        if start <= first and last <= end:
            updates = []
            for track in range(tracks):
                with _one_track(model, range(first, last), track, tracks):
                    updates.append(model.run_layers(hidden, positions, None, None, first, last) - hidden)
            hidden = hidden + sum(updates)
    return hidden


@contextlib.contextmanager
def _one_track(model: nn.Module, layers: range, track: int, tracks: int):
    """Masks v_proj's and up_proj's outputs (bias included) to ``track``'s share in ``layers``: a query head
    whose key/value head gives zero values adds nothing to o_proj, and SiLU(gate) · 0 adds nothing to down_proj."""
    def mask_hook(size: int):
        def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            keep = torch.arange(size, device=out.device) // (size // tracks) == track
            return out * keep.to(out.dtype)
        return hook

    handles = []
    try:
        for layer in layers:
            block = model.layers[layer]
            for proj in (block.self_attn.v_proj, block.mlp.up_proj):
                handles.append(proj.register_forward_hook(mask_hook(proj.out_features)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def segment_sync(held: dict[str, torch.Tensor], group: Any, count: SyncCount):
    """The segment's end: input + the all-reduced sum of every track's update to it."""
    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        x = held.pop("x")
        update = (out - x).contiguous()
        start = time.perf_counter()
        dist.all_reduce(update, group=group)
        count.add(time.perf_counter() - start, update.numel())
        return x + update
    return hook


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

    def send_error(self, error: BaseException) -> None:
        """A sharded draft's ranks: the first reports the error to the target, the others hear that it went."""
        if self.channel is None:
            self._follow(None)
            return
        self.channel.send_error(error)
        self._relay(SENT, torch.empty(0, dtype=torch.long))

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
