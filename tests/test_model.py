"""Our model against HF transformers as the oracle: logits, cache, layer-wise execution, masks."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import Transformer, kernels
from mirrorsd.model import causal_mask
from tests.helpers import HF_CONFIGS, assert_windows_and_trees_decode_bit_for_bit, requires_smollm2, tiny_hf

TOL = 1e-4


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_logits_match_hf(arch):
    hf = tiny_hf(arch, vocab=300, std=0.1)
    ours = Transformer.from_hf(hf)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        full = ours(ids)
        cache = ours.new_cache(rows=2, capacity=4)  # small capacity: exercises growth
        pieces = [ours(ids[:, a:b], cache=cache) for a, b in ((0, 9), (9, 10), (10, 17), (17, 24))]
    assert (full - ref).abs().max().item() < TOL
    assert (torch.cat(pieces, 1) - ref).abs().max().item() < TOL


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels did not build here")
def test_a_head_dim_beyond_the_kernels_stays_on_pytorch():
    """head_dim 288 (a multiple of 16 above the C++ attention's 256) was routed to the kernels, which refused every
    forward: the model could not run at all. It runs on the PyTorch layers, as an odd head_dim does."""
    hf = tiny_hf(vocab=300, hidden=64, std=0.1, head_dim=288, layers=2)
    ours = Transformer.from_hf(hf)
    assert not ours.make_row_exact()
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() < TOL


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels did not build here")
def test_empty_inputs_are_errors_not_crashes():
    """Zero keys with a mask read as causal through the mask's null data (a segfault); zero-width rows divided the
    parallel grain by zero (SIGFPE). Both killed the process instead of raising."""
    with pytest.raises(RuntimeError, match="no keys"):
        kernels.attend(torch.randn(1, 4, 2, 64), torch.zeros(1, 2, 0, 64), torch.zeros(1, 2, 0, 64),
                       torch.zeros(1, 2, 0, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="rows must not be empty"):
        kernels.rms_norm(torch.zeros(3, 0), torch.zeros(0), 1e-6)
    a, bt = torch.randn(16, 8), torch.randn(16, 32)
    assert kernels.lora_delta(torch.zeros(0, 8), a, bt, 1.0).shape == (0, 32)
    with pytest.raises(RuntimeError, match="rank must be positive"):
        kernels.lora_delta(torch.zeros(2, 8), torch.zeros(0, 8), torch.zeros(0, 32), 1.0)


def test_llama3_rope_scaling_matches_hf():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 100, (1, 40))
    with torch.no_grad():
        assert (Transformer.from_hf(hf)(ids) - hf(ids).logits).abs().max().item() < TOL


def test_unsupported_architecture_is_a_clear_error():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        from mirrorsd.model import ModelConfig

        ModelConfig.from_hf(GPT2Config())


def test_mlp_bias_is_refused():
    from transformers import LlamaConfig

    from mirrorsd.model import ModelConfig

    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf(LlamaConfig(mlp_bias=True))


def test_layerwise_execution_and_early_exit_match_hf_hidden_states():
    hf = tiny_hf("qwen2", layers=4, vocab=200, std=0.1)
    ours = Transformer.from_hf(hf)
    ids = torch.randint(0, 200, (1, 12))
    pos = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        cache = ours.new_cache()
        h_mid = ours.run_layers(ours.embed(ids), pos, cache, start=0, end=2)
        assert cache.lengths == [12, 12, 0, 0]
        h_top = ours.run_layers(h_mid, pos, cache, start=2)
        assert (h_mid - out.hidden_states[2]).abs().max().item() < TOL
        assert (ours.logits(h_top) - out.logits).abs().max().item() < TOL
        # Early exit: final norm + LM head applied to layer 2's hidden states.
        early_ref = hf.lm_head(hf.model.norm(out.hidden_states[2]))
        assert (ours.logits(h_mid) - early_ref).abs().max().item() < TOL


def test_tree_mask_equals_separate_branches():
    """Two branches after a shared prefix in one window, via an explicit mask and positions."""
    ours = Transformer.from_hf(tiny_hf(vocab=100, std=0.1))
    prefix, a, b = [5, 6, 7], [10, 11], [20, 21, 22]
    with torch.no_grad():
        ref_a = ours(torch.tensor([prefix + a]))[0, -len(a):]
        ref_b = ours(torch.tensor([prefix + b]))[0, -len(b):]
        cache = ours.new_cache()
        ours(torch.tensor([prefix]), cache=cache)
        tokens = torch.tensor([a + b])
        positions = torch.tensor([[3, 4, 3, 4, 5]])
        mask = torch.zeros(1, 5, 3 + 5, dtype=torch.bool)
        mask[..., :3] = True  # everyone sees the prefix
        for i, j in [(0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3), (4, 2), (4, 3), (4, 4)]:
            mask[0, i, 3 + j] = True
        out = ours(tokens, positions, cache, mask)[0]
    assert (out[:2] - ref_a).abs().max().item() < TOL
    assert (out[2:] - ref_b).abs().max().item() < TOL


def test_fixed_shapes_give_one_token_decodings_bits(monkeypatch):
    """The CUDA path without Triton (GEMMs and norms in fixed-row slabs, one SDPA call per query), forced on the
    CPU: after a 70-token prefill (two slabs) a window and a tree give exactly one-token decoding's logits."""
    import mirrorsd.execution
    import mirrorsd.linear
    import mirrorsd.model

    for module in (mirrorsd.execution, mirrorsd.linear, mirrorsd.model):
        monkeypatch.setattr(module, "fixed_shapes", lambda x: True)
    model = Transformer.from_hf(tiny_hf(vocab=100, std=0.1), linear="dense")
    assert_windows_and_trees_decode_bit_for_bit(model, torch.randint(0, 100, (70,)).tolist())


def test_rows_are_independent_sequences():
    ours = Transformer.from_hf(tiny_hf(vocab=100, std=0.1))
    ids = torch.randint(0, 100, (3, 10))
    with torch.no_grad():
        batched = ours(ids)
        for r in range(3):
            assert (batched[r] - ours(ids[r:r + 1])[0]).abs().max().item() < TOL


def test_prefix_model_is_first_layers_plus_head():
    hf = tiny_hf(layers=4, vocab=100, std=0.1)
    ours = Transformer.from_hf(hf)
    draft = ours.prefix_model(2)
    assert draft.config.n_layers == 2 and draft.lm_head is ours.lm_head
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states[2]
        assert (draft(ids) - hf.lm_head(hf.model.norm(hs))).abs().max().item() < TOL
    with pytest.raises(ValueError):
        ours.prefix_model(5)


def test_causal_mask_shape_and_content():
    m = causal_mask(2, 3)
    assert m.shape == (1, 3, 5)
    assert m[0].tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                             [True, True, True, True, True]]


#: The packed fp32 kernel sums each output sequentially over K (the same order for any number of rows, which
#: makes verification bit-identical to decoding); MKL blocks K differently. Over SmolLM2's 30 layers the two
#: orders drift apart by ~1e-5 of the logits' magnitude (~15), i.e. ~2e-4 absolute.
TOL_PACKED = 5e-4


@requires_smollm2
@pytest.mark.parametrize("linear", ["dense", "auto"])
def test_smollm2_logits_match_hf(smollm2, linear):
    ours, hf = smollm2
    model = ours.model if linear == "auto" else Transformer.from_pretrained(ours.path, linear="dense")
    tol = TOL_PACKED if linear == "auto" and kernels.available() else TOL
    ids = ours.tokenizer("The history of the printing press begins with", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = hf(ids).logits
        full = model(ids)
        cache = model.new_cache()
        inc = torch.cat([model(ids[:, :5], cache=cache), model(ids[:, 5:], cache=cache)], 1)
    assert (full - ref).abs().max().item() < tol
    assert (inc - ref).abs().max().item() < tol


@pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels")
def test_a_long_prompt_in_pieces_gives_the_same_bits(monkeypatch):
    """On the batch-invariant path a long window runs PREFILL_CHUNK tokens at a time: the cache and the logits
    it keeps are those of one forward over the whole window, bit for bit."""
    import mirrorsd.model
    from mirrorsd.loading import _is_projection
    from mirrorsd.quant import quantize_q8

    hf = tiny_hf("qwen2", layers=2, vocab=100, seed=4)
    state = {k.removeprefix("model."): v.detach() for k, v in hf.state_dict().items()}
    model = Transformer.from_state(hf.config, {k: quantize_q8(v) if _is_projection(k) else v for k, v in state.items()})
    assert model.fused and model.prefix_model(1).fused
    ids = torch.randint(0, 100, (2, 45), generator=torch.Generator().manual_seed(0))

    def run(chunk: int) -> list[torch.Tensor]:
        monkeypatch.setattr(mirrorsd.model, "PREFILL_CHUNK", chunk)
        prefilled, scored = model.new_cache(rows=2, capacity=8), model.new_cache(rows=2, capacity=8)
        with torch.inference_mode():
            model.prefill(ids[:, :40], prefilled)
            out = [model(ids[:, 40:], cache=prefilled), model(ids, cache=scored),
                   model(ids, cache=model.new_cache(rows=2, capacity=8), last=7)]
        return [*out, *(b[:, :, :45] for cache in (prefilled, scored) for b in (*cache.keys, *cache.values))]

    whole = run(1000)
    for chunk in (16, 7):  # 8 and 3 tokens per row: pieces that do not divide the window
        assert all(torch.equal(a, b) for a, b in zip(run(chunk), whole, strict=True))


def test_a_graph_kind_outside_the_list_is_refused():
    """Graph kinds share a cache's graph set and a new one evicts the graphs of its kind: a misspelt kind would
    evict another's (GRAPH_KINDS listed them, read by nothing)."""
    from mirrorsd.execution import static_graph

    model = Transformer.from_hf(tiny_hf(layers=1))
    with pytest.raises(ValueError, match="unknown graph kind 'drafts'"):
        static_graph(model, model.new_cache(capacity=4), ("drafts", model, None), 4, lambda pool: None)


def test_a_folder_we_cannot_run_or_read_is_refused_in_one_line(tmp_path, monkeypatch):
    """From a review of loading: an unsupported architecture was refused only after every weight was read (17 GB
    for a 7B), a cut-short safetensors file was a SafetensorError traceback, and an untied checkpoint without its
    head's shard silently used the embedding as the head."""
    from transformers import GPT2Config

    from mirrorsd import loading

    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(gpt2)
    (gpt2 / "model.safetensors").write_bytes(b"not read")
    monkeypatch.setattr(loading, "_merged", lambda *a: pytest.fail("weights read before the check"))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        Transformer.from_pretrained(gpt2, weights="fp32")
    monkeypatch.undo()
    hf = tiny_hf(layers=1, seed=1)
    hf.config.tie_word_embeddings = False
    hf.save_pretrained(tmp_path / "cut")
    weights = tmp_path / "cut" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="cannot be read .*incomplete or damaged"):
        Transformer.from_pretrained(tmp_path / "cut", weights="fp32")
    from safetensors.torch import load_file, save_file

    weights.write_bytes(whole)
    state = {k: v for k, v in load_file(weights).items() if k != "lm_head.weight"}
    save_file(state, weights)
    for weights in ("fp32", "q8"):
        with pytest.raises(ValueError, match="no lm_head.weight and its config does not tie"):
            Transformer.from_pretrained(tmp_path / "cut", weights=weights)
