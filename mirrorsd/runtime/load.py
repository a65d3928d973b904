"""Is anything else running? Timings and long CPU jobs next to another heavy process mean little here: on the
2-core VM two 2-thread jobs at once made each ~4× slower, not 2×."""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Other processes' share of all cores above which a benchmark or a training run warns.
BUSY_SHARE = 0.25


def others_cpu_share(interval: float = 0.5) -> float | None:
    """The share of all cores' time that other processes used over ``interval`` seconds (Linux ``/proc``; None
    elsewhere): this process's own time is subtracted, so loading the models just before does not count."""

    def sample() -> tuple[int, int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return sum(fields[:8]), idle, int(own[11]) + int(own[12])  # utime + stime, the same clock ticks

    try:
        total0, idle0, own0 = sample()
        time.sleep(interval)
        total1, idle1, own1 = sample()
    except (OSError, IndexError, ValueError):
        return None
    elapsed = total1 - total0
    return max(0.0, (elapsed - (idle1 - idle0) - (own1 - own0)) / elapsed) if elapsed > 0 else None


def busy_warning(share: float | None, what: str = "the benchmark") -> str | None:
    """The warning to print when other processes use more than :data:`BUSY_SHARE` of the cores, else None."""
    if share is None or share <= BUSY_SHARE:
        return None
    return (f"other processes were using {share:.0%} of the {os.cpu_count()} cores when {what} started: "
            "it will run slower, and timings taken next to another heavy job are slow and noisy")
