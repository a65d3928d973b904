"""The per-sync cost of a draft sharded over ranks (``mirrorsd generate --draft-tp``): all-reduces of a draft's
activation sizes timed over the ranks of a ``torchrun`` world, and the Mirror-SD paper's law
T_allreduce(M; G) = α log₂G + β·M fitted to them, with what it predicts for one draft step on more ranks:
2 all-reduces in the ``spd`` form, 2 per layer in the ``layer`` form.

    torchrun --nproc-per-node 2 -m mirrorsd.bench.allreduce --hidden 896 --layers 24 --predict 8

Rank 0 prints one JSON object. One host gives one G, so α and β come from the sizes (M = rows × hidden) at that G;
the prediction carries them to G ranks, which is the law's assumption, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist


def time_all_reduce(elements: int, repeats: int, group=None) -> float:
    """Median seconds of an all-reduce of ``elements`` float32 values over ``group``."""
    x = torch.ones(elements)
    for _ in range(5):
        dist.all_reduce(x, group=group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(x, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit(ranks: int, sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """α, β of T = α log₂G + β·M by least squares over the sizes at one G."""
    m_mean, t_mean = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((m - m_mean) ** 2 for m in sizes)
    beta = sum((m - m_mean) * (t - t_mean) for m, t in zip(sizes, seconds, strict=True)) / spread if spread else 0.0
    return (t_mean - beta * m_mean) / math.log2(ranks), beta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=896, help="the draft's hidden size (default: the 0.5B's)")
    p.add_argument("--layers", type=int, default=24, help="the draft's layers (default: the 0.5B's)")
    p.add_argument("--rows", default="1,8,64", help="rows per all-reduce to time (one fresh token; a rollout's roots)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--predict", type=int, default=8, help="ranks to predict a draft step's sync cost for")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    if ranks < 2:
        raise SystemExit("run it under torchrun with 2 or more ranks")
    rows = [int(r) for r in args.rows.split(",")]
    sizes = [r * args.hidden for r in rows]
    seconds = [time_all_reduce(m, args.repeats) for m in sizes]
    alpha, beta = fit(ranks, sizes, seconds)
    law = lambda m, g: alpha * math.log2(g) + beta * m  # noqa: E731
    if dist.get_rank() == 0:
        print(json.dumps({
            "ranks": ranks, "hidden": args.hidden, "layers": args.layers,
            "measured_ms": {r: round(1e3 * t, 4) for r, t in zip(rows, seconds, strict=True)},
            "alpha_ms": round(1e3 * alpha, 4), "beta_ns_per_element": round(1e9 * beta, 4),
            "predicted": {r: {"all_reduce_ms": round(1e3 * law(r * args.hidden, args.predict), 4),
                              "spd_step_ms": round(2e3 * law(r * args.hidden, args.predict), 4),
                              "layer_step_ms": round(2e3 * args.layers * law(r * args.hidden, args.predict), 4)}
                          for r in rows},
            "predicted_ranks": args.predict}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
