"""Python's cyclic garbage collector, paused while mirrorsd builds many long-lived objects at once.

Building a model (the GGUF reader's ~760k metadata views, the modules) or a suffix datastore (~230k lists and dicts)
triggers full collections, each walking every object of the process: ~190 ms apiece once a model is loaded, ~0.6 s
per model load and again for the first request that reads the datastore. The objects built live on, so those passes
free nothing. Collection resumes afterwards (nothing is frozen: garbage made while paused is still found later)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_collector() -> Iterator[None]:
    """No automatic collection inside the block; the collector's previous state (on or off) is restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
