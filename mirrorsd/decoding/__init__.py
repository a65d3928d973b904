"""Decoding methods on one loop (:mod:`.engine`), one module each, registered in :mod:`.registry`."""

# Importing a method module registers it; this order is the listing order.
from . import ar, sd  # noqa: F401, I001
from . import suffix, mirror, ss  # noqa: F401
from .engine import DecodeRequest, Draft, GenerationStats, RequestState, Roles, Scores
from .registry import Method, MethodOptions, ModelShape, OptionError, get_method, methods, option, register

__all__ = ["DecodeRequest", "Draft", "GenerationStats", "Method", "MethodOptions", "ModelShape", "OptionError",
           "RequestState", "Roles", "Scores", "get_method", "methods", "option", "register"]
