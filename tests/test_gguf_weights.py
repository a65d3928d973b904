"""GGUF block decoders and the quantized loader.

Tolerance: none. ``GroupQuant.dequantize()`` must equal ``gguf.quants.dequantize`` under ``torch.equal``
(so only the sign of a zero may differ): the module docstring of ``mirrorsd.gguf_weights`` shows that every
product involved is exact in float32 and that the one rounding left (Q4_1/Q4_K/Q5_K's add) is the same
rounding the reference does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

from mirrorsd import kernels, zoo
from mirrorsd.gguf_weights import (
    DECODERS,
    SUPER_FIELDS,
    decode_tensor,
    describe_gguf,
    gguf_to_hf_name,
    load_gguf_weights,
    open_gguf,
)
from mirrorsd.quant import GroupQuant
from tests.helpers import requires_smollm2

Q = GGMLQuantizationType
#: Byte offsets of the fp16 fields of each block type (every other byte may hold anything).
FP16_FIELDS = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw bytes ``uint8 [n, k // block * type_size]`` whose fp16 fields are finite (±0 included)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, type_size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        # Wide range of magnitudes, both signs, some subnormals and zeros.
        vals = rng.standard_normal((n, k // block)) * 10.0 ** rng.integers(-8, 3, size=(n, k // block))
        vals[rng.random((n, k // block)) < 0.05] = 0.0
        raw[..., at : at + 2] = vals.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_dequantize(raw, qtype), dtype=np.float32))


def test_every_decoder_has_test_fields():
    assert set(DECODERS) == set(FP16_FIELDS)


@pytest.mark.parametrize("qtype", list(FP16_FIELDS), ids=lambda t: t.name)
@pytest.mark.parametrize("n,blocks_per_row", [(1, 1), (5, 3), (7, 4)])
def test_decoder_matches_gguf_reference(qtype: GGMLQuantizationType, n: int, blocks_per_row: int):
    block, _ = GGML_QUANT_SIZES[qtype]
    k = block * blocks_per_row
    raw = random_blocks(qtype, n, k, seed=n * 100 + blocks_per_row)
    gq = decode_tensor(raw, qtype, (n, k))
    _, group, bits = DECODERS[qtype]

    assert isinstance(gq, GroupQuant)
    assert (gq.group, gq.bits) == (group, bits)
    assert gq.codes.dtype == torch.uint8 and gq.codes.shape == (n, k)
    assert gq.scales.dtype == gq.offsets.dtype == torch.float32
    assert gq.scales.shape == gq.offsets.shape == (n, k // group)
    assert int(gq.codes.max()) < 2**bits
    if qtype in SUPER_FIELDS:  # K-quants keep d (and -dmin) per 256: the kernels store int8 sub-scales
        assert gq.super_group == 256 and gq.super_scales.shape == (n, k // 256)
        assert (gq.super_offsets is None) == (qtype == Q.Q6_K)
        assert kernels.pack_quant(gq).scales.dtype == torch.int8  # raises unless scales == d * int8 exactly
    else:
        assert gq.super_scales is None and gq.super_group == 0
    want = reference(raw, qtype)
    got = gq.dequantize()
    assert torch.isfinite(want).all()
    assert torch.equal(got, want), f"max abs diff {(got - want).abs().max().item()}"


def test_codes_use_their_full_range():
    """Codes are shifted to unsigned, not clipped: random bytes reach both ends of the code range."""
    for qtype, (_, _, bits) in DECODERS.items():
        block, _ = GGML_QUANT_SIZES[qtype]
        codes = decode_tensor(random_blocks(qtype, 8, 8 * block), qtype, (8, 8 * block)).codes
        top = {Q.Q5_0: 31, Q.Q5_K: 31, Q.Q6_K: 63}.get(qtype, 2**bits - 1)
        assert (int(codes.min()), int(codes.max())) == (0, top), qtype.name


def test_plain_types_come_back_as_float32():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    assert torch.equal(decode_tensor(x, Q.F32, (3, 8)), torch.from_numpy(x))
    assert torch.equal(
        decode_tensor(x.astype(np.float16), Q.F16, (3, 8)), torch.from_numpy(x.astype(np.float16)).float()
    )
    bf16 = torch.from_numpy(x).bfloat16()
    raw = bf16.view(torch.int16).numpy().view(np.uint8)
    got = decode_tensor(raw, Q.BF16, (3, 8))
    assert got.dtype == torch.float32 and torch.equal(got, bf16.float())


def test_bad_inputs_are_refused():
    raw = random_blocks(Q.Q8_0, 2, 64)
    with pytest.raises(ValueError, match="bytes"):
        decode_tensor(raw, Q.Q8_0, (3, 64))
    with pytest.raises(ValueError, match="multiple"):
        decode_tensor(raw, Q.Q8_0, (2, 48))
    with pytest.raises(NotImplementedError):
        decode_tensor(raw, Q.IQ2_XXS, (2, 256))


def test_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(KeyError):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


def _assert_matches_checkpoint(name: str, reader: GGUFReader, *, tied: bool) -> None:
    """Every parameter of the converted fp32 checkpoint equals what we decoded from the GGUF.

    Read tensor by tensor (``safe_open``) rather than ``load_file``: the 0.5B checkpoint is 2.5 GB of fp32.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    folder = zoo.model_dir(name)
    weights = load_gguf_weights(reader, AutoConfig.from_pretrained(folder, local_files_only=True))
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert keys <= set(weights), f"missing: {sorted(keys - set(weights))[:5]}"
        for key in sorted(keys):
            want = f.get_tensor(key)
            w = weights[key]
            got = w.dequantize() if isinstance(w, GroupQuant) else w
            assert got.dtype == torch.float32 and got.shape == want.shape, key
            assert torch.equal(got, want), f"{key}: max abs diff {(got - want).abs().max().item()}"
    assert set(weights) == keys | {"lm_head.weight"}
    assert (weights["lm_head.weight"] is weights["model.embed_tokens.weight"]) == tied


@pytest.fixture(scope="module")
def smollm2_reader() -> GGUFReader:
    zoo.prepare("smollm2-135m", progress=False)
    return open_gguf(zoo.gguf_path("smollm2-135m"))


@requires_smollm2
def test_open_gguf_reads_what_gguf_reads(smollm2_reader: GGUFReader):
    """The faster reader (a plain view of the same mapping, arrays stepped over) parses the same scalar and string
    fields and the same tensors as gguf's own, and leaves out exactly the arrays (the tokenizer's)."""
    plain = GGUFReader(zoo.gguf_path("smollm2-135m"), "r")
    arrays = [k for k, f in plain.fields.items() if f.types[0] == GGUFValueType.ARRAY]
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= set(arrays)
    assert list(smollm2_reader.fields) == [k for k in plain.fields if k not in arrays]
    for key, field in smollm2_reader.fields.items():
        assert field.contents() == plain.fields[key].contents(), key
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in smollm2_reader.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in plain.tensors]
    for fast, reference in zip(smollm2_reader.tensors[:3], plain.tensors[:3], strict=True):
        assert np.array_equal(fast.data, reference.data)


@requires_smollm2
def test_smollm2_gguf_equals_converted_checkpoint(smollm2_reader: GGUFReader):
    """Proves the names, llama's Q/K un-permutation (9 q heads, 3 kv heads) and the tied head."""
    _assert_matches_checkpoint("smollm2-135m", smollm2_reader, tied=True)


@requires_smollm2
def test_smollm2_real_tensors_decode_like_gguf(smollm2_reader: GGUFReader):
    """Real Q8_0/Q4_1 bytes, decoded straight (no un-permutation), against the reference."""
    assert describe_gguf(smollm2_reader) == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    seen = set()
    for t in smollm2_reader.tensors:
        if t.tensor_type in DECODERS and t.tensor_type not in seen:
            seen.add(t.tensor_type)
            rows = t.data[:256]
            gq = decode_tensor(rows, t.tensor_type, (rows.shape[0], int(t.shape[0])))
            assert torch.equal(gq.dequantize(), reference(rows, t.tensor_type)), t.name
    assert seen == {Q.Q8_0, Q.Q4_1}


@pytest.mark.slow
def test_qwen_0_5b_gguf_equals_converted_checkpoint():
    """qwen2: Q5_0/Q8_0/Q4_K/Q6_K matrices, F32 biases, and a separate (untied) output.weight."""
    name = "qwen2.5-coder-0.5b"
    if not (zoo.gguf_path(name).exists() and (zoo.model_dir(name) / "model.safetensors").exists()):
        pytest.skip(f"{name} is not prepared (mirrorsd models prepare {name})")
    reader = open_gguf(zoo.gguf_path(name))
    assert set(describe_gguf(reader)) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"}
    _assert_matches_checkpoint(name, reader, tied=False)


def _written_gguf(path, tensors: dict[str, np.ndarray], **writer) -> str:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama", **writer)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_gguf_of_another_kind_is_one_clear_error(tmp_path):
    """A user's GGUF with a tensor we have no name for (a mixture of experts) or that is big-endian (the block
    decoders read little-endian fields: it would load as noise) is refused with a ValueError naming the file, which
    the CLI prints as one line; it was a KeyError traceback, or silent garbage."""
    from gguf import GGUFEndian

    moe = _written_gguf(tmp_path / "moe.gguf", {"blk.0.ffn_gate_exps.weight": np.ones((4, 8), np.float32)})
    with pytest.raises(ValueError, match=r"moe\.gguf: no Hugging Face name known .*--weights fp32"):
        load_gguf_weights(moe, {})
    big = _written_gguf(tmp_path / "big.gguf", {"token_embd.weight": np.ones((4, 8), np.float32)},
                        endianess=GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian"):
        load_gguf_weights(big, {})
