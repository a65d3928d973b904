"""Where mirrorsd keeps what it builds: ``$MIRRORSD_CACHE`` or ``~/.cache/mirrorsd`` (zoo models, kernels, packed
weights, plans).

Its own module so that low layers (the kernels) can find it without importing the zoo."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "MIRRORSD_CACHE"


class CacheDirError(ValueError):
    """The cache folder is a file, or cannot be created or written: one line naming the path and the variable."""


def _named(root: Path) -> str:
    env = os.environ.get(ENV)
    return f"{ENV}={env}" if env else f"the default cache folder {root}"


def _fix() -> str:
    return f"point {ENV} at a writable folder" if os.environ.get(ENV) else f"set {ENV} to a writable folder"


def cache_dir() -> Path:
    """Root of the cache: ``$MIRRORSD_CACHE`` if set, else ``~/.cache/mirrorsd``.

    Raises :class:`CacheDirError` when that path is an existing file (it may not exist yet: see
    :func:`ensure_cache_dir`)."""
    env = os.environ.get(ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "mirrorsd"
    if root.exists() and not root.is_dir():
        raise CacheDirError(f"{_named(root)} is a file, not a folder; {_fix()}")
    return root


def ensure_cache_dir(folder: Path | None = None) -> Path:
    """Create ``folder`` (default: the cache root; else a folder inside it) and check it is writable.

    Raises :class:`CacheDirError` instead of the ``FileExistsError`` / ``PermissionError`` that ``mkdir``
    would give deep inside a caller."""
    root = cache_dir()
    folder = root if folder is None else Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = f" ({e.strerror}: {e.filename})" if e.strerror and e.filename else f" ({e})"
        raise CacheDirError(f"{_named(root)} cannot be used: {folder} cannot be created{where}; {_fix()}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CacheDirError(f"{_named(root)} cannot be used: {folder} is not writable; {_fix()}")
    return folder
