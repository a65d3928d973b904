"""Load a GGUF checkpoint *as quantized*: every weight becomes a :class:`GroupQuant` instead of fp32.

transformers' GGUF loader dequantizes everything to fp32 (a 0.5B model becomes 2.5 GB). Here each GGML
block type is rewritten, without loss, as ``codes · scale + offset`` per group of consecutive input
features, which is the one format our quantized linear layers run on. The decoders follow ggml's element
order exactly (as mirrored by ``gguf.quants``), and the scale/offset are computed in float32 so that
``GroupQuant.dequantize()`` reproduces ``gguf.quants.dequantize`` value for value:

* Q8_0/Q4_0/Q5_0/Q6_K: the reference computes ``d·(q - c)``; we compute ``q·d + (-c·d)``. Both products
  are exact in float32 (fp16 ``d`` has 11 significant bits, ``d·sc`` at most 18, times a code of at most 6
  bits ≤ 24), and so is the sum, because the true result ``d·(q - c)`` is itself representable.
* Q4_1/Q4_K/Q5_K: the reference computes ``(d·sc)·q - dmin·m`` with one rounding in the final add/sub;
  we compute the same exact product and the same single rounding.

So the match is exact (``torch.equal``), with the one caveat that a zero may differ in sign.

Names come back as the Hugging Face parameter names of the converted ``model.safetensors``; for the
``llama`` GGUF architecture the rows of ``attn_q``/``attn_k`` are un-permuted the way transformers does
(llama.cpp's converter interleaves the rotary halves of each head). Row permutation is legal on a
GroupQuant because groups run along the input (K) dimension.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize as _gguf_dequantize

from .quant import GroupQuant

__all__ = ["DECODERS", "decode_tensor", "describe_gguf", "gguf_to_hf_name", "load_gguf_weights", "open_gguf"]

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
#: A block decoder maps raw blocks ``uint8 [R, nb, type_size]`` to codes ``uint8 [R, nb, block]`` and
#: per-group scales/offsets ``float32 [R, nb, block // group]``.
BlockDecoder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]

#: Elements decoded per chunk of rows: bounds the numpy temporaries (a 151936×1536 head decodes in pieces).
_CHUNK_ELEMS = 1 << 22


# ------------------------------------------------------------------------------------------ helpers
def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of every block, as float32 ``[R, nb]``."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., n]`` bytes → ``[..., 2n]`` codes: all low nibbles first, then all high nibbles (ggml order)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12 bytes of 6-bit scales and mins of Q4_K/Q5_K into two ``uint8 [R, nb, 8]``."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


# ---------------------------------------------------------------------------------- block decoders
def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # fp16 d, 32 × int8; int8 q + 128 is its uint8 bit pattern with the top bit flipped.
    d = _f16(b, 0)[..., None]
    return b[..., 2:34] ^ np.uint8(0x80), d, np.float32(-128) * d


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)[..., None]
    return _nibbles(b[..., 2:18]), d, np.float32(-8) * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[..., 4:20]), _f16(b, 0)[..., None], _f16(b, 2)[..., None]


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # fp16 d, uint32 qh (bit i = 5th bit of element i, little-endian), 16 bytes of nibbles.
    d = _f16(b, 0)[..., None]
    qh = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")
    return _nibbles(b[..., 6:22]) | (qh << np.uint8(4)), d, np.float32(-16) * d


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # fp16 d, fp16 dmin, 12 bytes scales/mins, 128 bytes: four 64-element chunks of 32 bytes each.
    r, nb = b.shape[:2]
    sc, mn = _k_scale_min(b[..., 4:16])
    scale = _f16(b, 0)[..., None] * sc.astype(np.float32)
    offset = -(_f16(b, 2)[..., None] * mn.astype(np.float32))
    codes = _nibbles(b[..., 16:144].reshape(r, nb, 4, 32)).reshape(r, nb, 256)
    return codes, scale, offset


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Q4_K plus 32 bytes qh: bit i of qh[l] is the 5th bit of element l of sub-block i.
    r, nb = b.shape[:2]
    sc, mn = _k_scale_min(b[..., 4:16])
    scale = _f16(b, 0)[..., None] * sc.astype(np.float32)
    offset = -(_f16(b, 2)[..., None] * mn.astype(np.float32))
    ql = _nibbles(b[..., 48:176].reshape(r, nb, 4, 32)).reshape(r, nb, 8, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(8, 1)
    qh = (b[..., None, 16:48] >> shifts) & np.uint8(1)
    return (ql | (qh << np.uint8(4))).reshape(r, nb, 256), scale, offset


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # 128 bytes ql, 64 bytes qh, 16 × int8 scales, fp16 d. Each 128-element half uses 64 ql and 32 qh bytes.
    r, nb = b.shape[:2]
    ql = _nibbles(b[..., 0:128].reshape(r, nb, 2, 64))  # [r, nb, 2, 128]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    qh = ((b[..., 128:192].reshape(r, nb, 2, 1, 32) >> shifts) & np.uint8(3)).reshape(r, nb, 2, 128)
    codes = (ql | (qh << np.uint8(4))).reshape(r, nb, 256)
    scale = _f16(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
    return codes, scale, np.float32(-32) * scale


#: GGML type → (decoder, group size, bits of the codes).
DECODERS: dict[GGMLQuantizationType, tuple[BlockDecoder, int, int]] = {
    Q.Q8_0: (_q8_0, 32, 8),
    Q.Q4_0: (_q4_0, 32, 4),
    Q.Q4_1: (_q4_1, 32, 4),
    Q.Q5_0: (_q5_0, 32, 8),
    Q.Q4_K: (_q4_k, 32, 4),
    Q.Q5_K: (_q5_k, 32, 8),
    Q.Q6_K: (_q6_k, 16, 8),
}
_PLAIN = (Q.F32, Q.F16, Q.BF16)
#: K-quants: byte offsets of the fp16 d (the super scale) and dmin (minus the super offset; None: symmetric) in a
#: 256-weight block.
SUPER_FIELDS: dict[GGMLQuantizationType, tuple[int, int | None]] = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None)}


def decode_tensor(
    data: np.ndarray, qtype: GGMLQuantizationType | int, shape: tuple[int, ...]
) -> GroupQuant | torch.Tensor:
    """Raw GGUF bytes of one tensor → a GroupQuant (quantized types) or a float32 tensor (F32/F16/BF16).

    ``shape`` is in PyTorch order (``[N rows, K cols]``; ggml lists it reversed). Rows are decoded in
    chunks so that only the outputs, not the numpy temporaries, scale with the tensor.
    """
    qtype = Q(qtype)
    shape = tuple(int(s) for s in shape)
    if qtype in _PLAIN:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        return torch.from_numpy(np.array(_gguf_dequantize(raw, qtype), dtype=np.float32)).reshape(shape)
    if qtype not in DECODERS:
        raise NotImplementedError(f"GGUF type {qtype.name} has no GroupQuant decoder (have {_names(DECODERS)})")
    if len(shape) != 2:
        raise ValueError(f"quantized tensors must be 2-D [N, K], got shape {shape} ({qtype.name})")
    decode, group, bits = DECODERS[qtype]
    block, type_size = GGML_QUANT_SIZES[qtype]
    n, k = shape
    if k % block:
        raise ValueError(f"row length {k} is not a multiple of the {qtype.name} block size {block}")
    nb = k // block
    raw = np.ascontiguousarray(data).view(np.uint8)
    if raw.size != n * nb * type_size:
        raise ValueError(f"{raw.size} bytes do not hold a {qtype.name} tensor of shape {shape}")
    blocks = raw.reshape(n, nb, type_size)

    codes = torch.empty((n, k), dtype=torch.uint8)
    scales = torch.empty((n, k // group), dtype=torch.float32)
    offsets = torch.empty((n, k // group), dtype=torch.float32)
    codes_np, scales_np, offsets_np = codes.numpy(), scales.numpy(), offsets.numpy()
    d_at, dmin_at = SUPER_FIELDS.get(qtype, (None, None))
    super_scales = torch.empty((n, nb), dtype=torch.float32) if d_at is not None else None
    super_offsets = torch.empty((n, nb), dtype=torch.float32) if dmin_at is not None else None
    step = max(1, _CHUNK_ELEMS // k)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        c, s, o = decode(blocks[lo:hi])
        codes_np[lo:hi] = c.reshape(hi - lo, k)
        scales_np[lo:hi] = s.reshape(hi - lo, -1)
        offsets_np[lo:hi] = o.reshape(hi - lo, -1)
        if super_scales is not None:
            super_scales.numpy()[lo:hi] = _f16(blocks[lo:hi], d_at)
        if super_offsets is not None:
            super_offsets.numpy()[lo:hi] = -_f16(blocks[lo:hi], dmin_at)
    return GroupQuant(codes=codes, scales=scales, offsets=offsets, group=group, bits=bits, super_scales=super_scales,
                      super_offsets=super_offsets, super_group=block if super_scales is not None else 0)


def _names(types: Any) -> str:
    return ", ".join(t.name for t in types)


# ------------------------------------------------------------------------------------------ names
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
#: GGUF tensors that are not model parameters (llama3's rope scaling factors are recomputed from config).
_NOT_PARAMETERS = {"rope_freqs.weight"}


def gguf_to_hf_name(name: str) -> str:
    """GGUF tensor name → HF parameter name of a dense llama/mistral/qwen2/qwen3 model (KeyError if unknown)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise KeyError(f"no Hugging Face name known for GGUF tensor {name!r}")


# ------------------------------------------------------------------------------------------ loading
def _cfg(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


class _PlainViewReader(GGUFReader):
    """gguf's reader over a plain ndarray view of its memmap (the same mapped bytes), stepping over arrays.

    gguf parses every metadata value with a slice of ``data``; slicing an ``np.memmap`` builds a memmap object each
    time (``__array_finalize__``), which made the parse of a Qwen GGUF take ~7 s, ~2 s on a plain view. Most of the
    values are the tokenizer's arrays (vocabulary, merges, token types: ~450k items in a Qwen GGUF), parsed item by
    item: they are stepped over instead and left out of ``fields`` (the tokenizer comes from the converted HF
    folder), which takes the parse to 0.1 s and a small model's load from ~3.3 to ~1.7 s."""

    #: bytes per item of an array of each type (a string's length is read as it is stepped over)
    ARRAY_TYPES = {GGUFValueType.STRING: 0,
                   **{t: np.dtype(d).itemsize for t, d in GGUFReader.gguf_scalar_to_np.items()}}

    def __init__(self, path: str, mode: str = "r") -> None:
        self.path = path  # (for errors that name the file)
        super().__init__(path, mode)
        for key in [k for k, f in self.fields.items() if f.types[:1] == [GGUFValueType.ARRAY] and not f.data]:
            del self.fields[key]  # (stepped over: no items parsed)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = struct.unpack_from("<IQ", self._plain, orig_offs)
        size = self.ARRAY_TYPES.get(item_type)
        if size is None:  # (arrays of arrays)
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12 + size * count
        if item_type == GGUFValueType.STRING:
            for _ in range(count):  # each string: a uint64 length, then its bytes
                offs += 8 + struct.unpack_from("<Q", self._plain, offs)[0]
        return (offs - orig_offs, [self._get(orig_offs, np.uint8, offs - orig_offs)], [],
                [GGUFValueType.ARRAY, GGUFValueType(item_type)])

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._mapped = mapped  # keeps the mapping open
        self._plain = mapped.view(np.ndarray)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A read-only :class:`GGUFReader` of ``path`` (tensor data stays memory-mapped). A big-endian file is refused:
    the block decoders read little-endian fields, so its weights would load as noise."""
    reader = _PlainViewReader(os.fspath(path), "r")
    if reader.byte_order != "I":
        raise ValueError(f"{os.fspath(path)} is a big-endian GGUF, which mirrorsd cannot read: convert it with "
                         "llama.cpp's gguf tools, or use --weights fp32")
    return reader


def _field(reader: GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _unpermute_rows(w: GroupQuant | torch.Tensor, n_head: int) -> GroupQuant | torch.Tensor:
    """Undo llama.cpp's Q/K row interleave (transformers' ``_reverse_permute_weights``).

    The converter stored, per head, rows ``(dim, 2)``; HF wants ``(2, dim)``: the new row ``(h, a, b)`` is
    the old row ``(h, b, a)``.
    """
    n = w.shape[0]
    if n % (2 * n_head):
        raise ValueError(f"{n} rows do not split into {n_head} heads of an even size")
    perm = torch.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(1, 2).reshape(-1)
    return w.select_rows(perm) if isinstance(w, GroupQuant) else w.index_select(0, perm)


def load_gguf_weights(path: str | os.PathLike | GGUFReader, config: Any) -> dict[str, GroupQuant | torch.Tensor]:
    """Every weight of a GGUF file, keyed by HF parameter name; matrices stay quantized (GroupQuant).

    ``config`` is the HF config of the converted folder (a ``PretrainedConfig`` or a dict): it gives the
    head counts for llama's Q/K un-permutation and whether the head is tied. With a tied (or missing)
    ``output.weight``, ``lm_head.weight`` is the very same object as ``model.embed_tokens.weight``.
    Norms and biases come back as float32 tensors. Tensors are decoded one at a time from the mmap.
    An open ``GGUFReader`` may be passed instead of a path: parsing the metadata (the tokenizer's vocabulary
    and merges) is most of the load time of a small model.
    """
    reader = path if isinstance(path, GGUFReader) else open_gguf(path)
    source = getattr(reader, "path", "the GGUF file")
    arch = _field(reader, "general.architecture")
    tied = bool(_cfg(config, "tie_word_embeddings", False))
    n_head = _cfg(config, "num_attention_heads") or _field(reader, f"{arch}.attention.head_count")
    n_kv = _cfg(config, "num_key_value_heads") or _field(reader, f"{arch}.attention.head_count_kv") or n_head

    out: dict[str, GroupQuant | torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _NOT_PARAMETERS:
            continue
        if t.name == "output.weight" and tied:
            log.debug("config ties the head: ignoring GGUF output.weight")
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # ggml (ne0=K, ne1=N) → torch (N, K)
        try:
            hf = gguf_to_hf_name(t.name)
            w = decode_tensor(t.data, t.tensor_type, shape)
        except (KeyError, NotImplementedError) as e:  # a user's GGUF of another kind: one line, not a traceback
            raise ValueError(f"{source}: {e.args[0]}; --weights fp32 loads the folder's "
                             "converted checkpoint instead") from None
        # transformers' LlamaTensorProcessor keys on the GGUF architecture, so do we.
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = _unpermute_rows(w, int(n_head if ".attn_q." in t.name else n_kv))
        out[hf] = w
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def describe_gguf(path: str | os.PathLike | GGUFReader) -> dict[str, int]:
    """Number of tensors per GGML type (e.g. ``{"Q4_K": 169, "Q6_K": 29, "F32": 141}``), most common first."""
    reader = path if isinstance(path, GGUFReader) else open_gguf(path)
    return dict(Counter(Q(t.tensor_type).name for t in reader.tensors).most_common())
