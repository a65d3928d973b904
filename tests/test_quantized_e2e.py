"""Quantized models are their own targets: on SmolLM2's q4 (its GGUF codes) and q8 weights, every method
must give exactly that model's AR tokens; and the quantized model must stay close to the fp32 one."""

from __future__ import annotations

import pytest
import torch

import mirrorsd
from mirrorsd import Transformer, generate
from mirrorsd.linear import QuantLinear
from mirrorsd.model import QuantEmbedding
from tests.helpers import requires_smollm2

pytestmark = requires_smollm2

PROMPTS = ["The history of the printing press begins", "def quicksort(arr):"]
N_NEW = 32


@pytest.fixture(scope="module", params=["q4", "q8"])
def quantized(request):
    return mirrorsd.load_model("smollm2-135m", weights=request.param, progress=False)


def test_quantized_layers_are_used(quantized):
    layers = [m for m in quantized.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 7 * quantized.config.n_layers + 1  # every projection and the head


def test_a_q4_embedding_stays_quantized_and_looks_up_the_rows_a_dense_table_holds(quantized, request):
    """The GGUF's embedding is not dequantized whole at load (0.9 GB for the 1.5B); a lookup's rows are the dense
    table's, bit for bit, and so is ``.weight`` (a tied head's or a trainer's)."""
    embed = quantized.model.embed_tokens
    if request.node.callspec.params["quantized"] == "q8":  # q8 quantizes the projections only
        assert isinstance(embed, torch.nn.Embedding) and embed.weight.dtype == torch.float32
        return
    assert isinstance(embed, QuantEmbedding)
    dense = embed.quant.dequantize()
    ids = torch.tensor([[0, 5, quantized.config.vocab_size - 1], [7, 7, 1]])
    assert torch.equal(embed(ids), dense[ids]) and torch.equal(embed.weight, dense)
    assert quantized.model.device == torch.device("cpu") and quantized.model.dtype == torch.float32


#: Over 70 tokens: ar prefills it whole while sd prefills all but the last token and verifies that one in
#: its first window, so the two group the same tokens differently from the first step on.
LONG_PROMPT = ("Summarise the following notes in one sentence. " * 3 + "The printing press, invented around 1440, "
               "spread literacy across Europe, lowered the cost of books, and helped standardise languages; "
               "within fifty years presses ran in more than two hundred cities. Summary:")


@pytest.mark.parametrize("prompt", [*PROMPTS, LONG_PROMPT])
def test_every_method_equals_quantized_ar_exactly(smollm2, quantized, prompt):
    """Bit-exact kernels and row-by-row attention: no near-tie allowance at all, whatever the grouping."""
    fp32, _ = smollm2
    ids = quantized.tokenizer(prompt)["input_ids"]
    assert prompt != LONG_PROMPT or len(ids) > 70
    ar = generate(quantized, prompt, method="ar", max_new_tokens=N_NEW, raw=True)
    drafts = {"self": quantized.model, "prefix": quantized.model.prefix_model(4), "fp32": fp32.model}
    policies = ({"gamma": 4, "confidence": 0.0}, {}, {"gamma": 70, "confidence": 0.0})
    for name, draft in drafts.items():
        for options in policies:
            sd = generate(quantized, prompt, draft=draft, method="sd", max_new_tokens=N_NEW, raw=True, **options)
            assert sd.token_ids == ar.token_ids, (name, options)
    # the other methods (eagle needs a trained head, which none ships): mirror rolling out (its serial budget is 0)
    others = {"suffix": {}, "ss": {}, "mirror": {"draft": quantized.model.prefix_model(4), "budget": 2}}
    for method, options in others.items():
        got = generate(quantized, prompt, method=method, max_new_tokens=N_NEW, raw=True, **options)
        assert got.token_ids == ar.token_ids, method


def test_seeded_sampling_equal_on_quantized(quantized):
    kw = dict(temperature=0.8, top_p=0.95, seed=3, max_new_tokens=24)
    ar = generate(quantized, PROMPTS[0], method="ar", **kw)
    sd = generate(quantized, PROMPTS[0], method="sd", draft=quantized.model.prefix_model(6), gamma=3, **kw)
    assert sd.token_ids == ar.token_ids


def test_verification_window_is_bit_identical_to_decoding(quantized):
    """Batch invariance end to end: a k-token window gives the very logits k one-token steps give."""
    model = quantized.model
    ids = torch.tensor([quantized.tokenizer(PROMPTS[1])["input_ids"]])
    with torch.inference_mode():
        cache = model.new_cache()
        model(ids[:, :-4], cache=cache, last=1)
        window = model(ids[:, -4:], cache=cache)
        cache.truncate(ids.shape[1] - 4)
        steps = torch.cat([model(ids[:, i : i + 1], cache=cache) for i in range(ids.shape[1] - 4, ids.shape[1])], 1)
    assert torch.equal(window, steps)


def test_quantized_model_stays_close_to_fp32(smollm2, quantized):
    fp32, _ = smollm2
    ids = torch.tensor([fp32.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n")["input_ids"]])
    with torch.inference_mode():
        ref = fp32.model(ids)
        out = quantized.model(ids)
    agree = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    # q4 uses the very codes the fp32 checkpoint was dequantized from: only int8 activations differ.
    assert agree >= 0.9
    per_token_kl = torch.nn.functional.kl_div(out[0].log_softmax(-1), ref[0].log_softmax(-1), log_target=True,
                                              reduction="batchmean")
    assert per_token_kl.item() < 0.01


def test_quantized_formats_refuse_gpu_and_low_precision(smollm2):
    ours, _ = smollm2
    with pytest.raises(ValueError, match="CPU in fp32 only"):
        Transformer.from_pretrained(ours.path, weights="q4", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weights must be one of"):
        Transformer.from_pretrained(ours.path, weights="int3")
