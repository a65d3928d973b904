"""mirrorsd: lossless speculative decoding on real pretrained models.

Today: the target alone (``ar``), vanilla speculative decoding (``sd``) and Mirror-SD (``mirror``); Speculative
Streaming builds on the same model, cache and verification layers.
"""

from .api import Generation, GenerationStream, LoadedModel, generate, load_model, stream
from .decoding import METHODS, GenerationStats
from .model import Transformer
from .sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "Generation",
    "GenerationStats",
    "GenerationStream",
    "LoadedModel",
    "SamplingParams",
    "Transformer",
    "generate",
    "load_model",
    "stream",
]
