"""Decoding methods, one module each; a method is one name in :data:`METHODS`."""

from collections.abc import Callable, Iterator

from . import ar, mirror, sd, ss
from .base import DecodeRequest, GenerationStats

Method = Callable[[DecodeRequest], Iterator[list[int]]]

METHODS: dict[str, Method] = {"ar": ar.decode, "sd": sd.decode, "mirror": mirror.decode, "ss": ss.decode}
SPECULATIVE = {"sd", "mirror"}  # methods that need a draft model

__all__ = ["METHODS", "SPECULATIVE", "DecodeRequest", "GenerationStats", "Method"]
