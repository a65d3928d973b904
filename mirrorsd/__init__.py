"""mirrorsd: lossless speculative decoding on real pretrained models.

Methods (``mirrorsd methods`` lists them): the target alone (``ar``), vanilla speculative decoding (``sd``),
Mirror-SD (``mirror``) and Speculative Streaming (``ss``), all on one decoding loop (:mod:`mirrorsd.decoding`).
"""

from .api import Generation, GenerationStream, LoadedModel, generate, load_model, stream
from .decoding import GenerationStats, methods
from .model import Transformer
from .sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "Generation",
    "GenerationStats",
    "GenerationStream",
    "LoadedModel",
    "SamplingParams",
    "Transformer",
    "generate",
    "load_model",
    "methods",
    "stream",
]
