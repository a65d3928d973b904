"""Decoding methods on one loop (:mod:`.engine`), one module or package each, registered in :mod:`.registry`."""

# Importing a method module registers it; this order is the listing order.
from . import ar, suffix, sd, mirror  # noqa: F401, I001
from .ss import method as _ss  # noqa: F401
from .eagle import method as _eagle  # noqa: F401
from .engine import DecodeRequest, Proposal, GenerationStats, RequestState, Roles, Scores
# The processes backend's draft rank under torchrun (``mirrorsd generate --target-tp``): the CLI starts and ends it.
from .mirror.remote import leave_launched_world, serve_launched
from .registry import (REFERENCE, Method, MethodOptions, ModelShape, OptionError, Priced, ShippedFiles, default_method,
                       get_method, methods, option, register)

__all__ = ["REFERENCE", "DecodeRequest", "Proposal", "GenerationStats", "Method", "MethodOptions", "ModelShape",
           "OptionError", "Priced", "RequestState", "Roles", "Scores", "ShippedFiles", "default_method", "get_method",
           "leave_launched_world", "methods", "option", "register", "serve_launched"]
