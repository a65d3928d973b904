"""Where mirrorsd keeps what it builds: ``$MIRRORSD_CACHE`` or ``~/.cache/mirrorsd`` (zoo models, kernels, plans).

Its own module so that low layers (the kernels) can find it without importing the zoo."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of the cache: ``$MIRRORSD_CACHE`` if set, else ``~/.cache/mirrorsd``."""
    env = os.environ.get("MIRRORSD_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mirrorsd"
