"""mirrorsd: lossless speculative decoding on real pretrained models.

Methods (``mirrorsd methods`` lists them): the target alone (``ar``), draft-free suffix decoding (``suffix``),
vanilla speculative decoding (``sd``), Mirror-SD (``mirror``) and Speculative Streaming (``ss``), all on one
decoding loop (:mod:`mirrorsd.decoding`); ``auto`` picks the fastest for this machine.
"""

from . import plans
from .api import Generation, GenerationStream, LoadedModel, StreamDelta, generate, load_model, stream
from .decoding import GenerationStats, methods
from .model import Transformer
from .prefix_cache import PrefixCache
from .sampling import SamplingParams


def _quick_plan(target: LoadedModel, draft: LoadedModel | None) -> dict:
    """``method="auto"`` on first use (the planner lives in the benchmark layer, above the API)."""
    from .bench.plan import quick_plan

    return quick_plan(target, draft)


plans.set_planner(_quick_plan)

__version__ = "0.1.0"

__all__ = [
    "Generation",
    "GenerationStats",
    "GenerationStream",
    "LoadedModel",
    "PrefixCache",
    "SamplingParams",
    "StreamDelta",
    "Transformer",
    "generate",
    "load_model",
    "methods",
    "stream",
]
