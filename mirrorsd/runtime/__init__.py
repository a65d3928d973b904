"""Devices and concurrency: where a method's two halves run and how their time is recorded."""

from .executors import BACKENDS, Executor, make_executor
from .trace import Span, Tracer, synchronize, write_chrome_trace

__all__ = ["BACKENDS", "Executor", "Span", "Tracer", "make_executor", "synchronize", "write_chrome_trace"]
