"""Devices and concurrency: where a method's two halves run and how their time is recorded."""

from .backends import make_executor
from .executors import BACKENDS, Executor
from .trace import Span, Tracer, synchronize, write_chrome_trace

__all__ = ["BACKENDS", "Executor", "Span", "Tracer", "make_executor", "synchronize", "write_chrome_trace"]
