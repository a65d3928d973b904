"""A q4 checkpoint as our kernels hold it, kept on disk: a later load reads it back instead of decoding and
repacking the GGUF file.

Why: a q4 load of the 1.5B took ~14 s on 2 cores (AVX2), ~6 s of it decoding the GGUF's K-quant blocks and ~5 s
repacking the codes into the kernels' interleaved layout, at every CLI call, server start and test. Both depend only
on the GGUF file, its config, the code widths this CPU's kernels take and this code, so the first load writes what
the layers keep (packed projections, the quantized embedding, norms, biases) into one safetensors file under
``$MIRRORSD_CACHE/packed/`` and later loads build the model from it: the same bytes, so the same logits bit for bit.

``MIRRORSD_WEIGHT_CACHE=0`` turns it off. A file that cannot be read is dropped and the checkpoint decoded again; a
changed GGUF file, config, CPU or source file gets a new file name (and this install's older file of the model is
removed; another install's, a release beside a dev tree sharing the cache, stays).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from torch import nn

from . import kernels
from .cache import CacheDirError, cache_dir, ensure_cache_dir
from .linear import PACKED_BUFFERS, PackedWeight, QuantLinear
from .model import QuantEmbedding, RMSNorm, Transformer, Weights
from .quant import GroupQuant

ENV = "MIRRORSD_WEIGHT_CACHE"
#: Bumped when the file's layout changes.
FORMAT = "1"
#: The sources whose code decides the cached bytes or how they are read back.
SOURCES = ("gguf_weights.py", "quant.py", "kernels/__init__.py", "linear.py", "model.py", "loading.py",
           "weight_cache.py")
_QUANT_FIELDS = ("codes", "scales", "offsets", "super_scales", "super_offsets")
STALE_WRITE_S = 3600  # a half-written file this old is a killed writer's, not one in progress

log = logging.getLogger(__name__)
_CODE = str(Path(__file__).resolve().parent)  # which install wrote a file (files without one: an older install's)


def file_for(gguf: Path, linear: str) -> Path | None:
    """Where ``gguf``'s packed weights are (or will be) kept; None where the cache does not apply: turned off, a
    ``linear`` other than ``auto``, or no CPU kernels (the layers then keep codes, not packed weights)."""
    if os.environ.get(ENV, "1") == "0" or linear != "auto" or not kernels.available():
        return None
    stat = gguf.stat()
    config = gguf.parent / "config.json"
    here = Path(__file__).parent
    parts = [FORMAT.encode(), str(stat.st_size).encode(), str(stat.st_mtime_ns).encode(),
             config.read_bytes() if config.exists() else b"", str(kernels.isa()).encode(),
             repr(kernels.code_widths()).encode(), torch.__version__.encode(),
             *((here / source).read_bytes() for source in SOURCES)]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return _folder() / f"{_stem(gguf)}-{key}.safetensors"


def load(file: Path) -> Weights | None:
    """The weights kept in ``file`` as a :class:`~mirrorsd.model.Transformer` takes them, or None when there is
    none (or it cannot be read: then it is removed)."""
    if not file.exists():
        return None
    if not os.access(file, os.R_OK):  # another user's file in a shared cache (safetensors says "No such file")
        warnings.warn(f"cannot read the packed weights at {file} (permission denied); decoding the GGUF file "
                      "instead", RuntimeWarning, stacklevel=3)
        return None
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            entries = json.loads(f.metadata()["weights"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        state = {name: _rebuilt(name, entry, tensors) for name, entry in entries.items()}
    except Exception as error:  # noqa: BLE001 - a cut-short or foreign file: decode the checkpoint instead
        warnings.warn(f"ignoring the packed weights at {file} ({type(error).__name__}: {error}); decoding the GGUF "
                      "file again", RuntimeWarning, stacklevel=3)
        file.unlink(missing_ok=True)
        return None
    log.debug("packed weights read from %s", file)
    return state


def store(file: Path, model: Transformer, source: Path) -> None:
    """Keep ``model``'s weights, decoded from the GGUF file ``source``, in ``file`` for the next load (nothing when
    the model holds a layer this file cannot describe, or the disk lacks room: the next load then decodes again)."""
    state = _state(model)
    if state is None:
        return
    arrays, entries = {}, {}
    for name, value in state.items():
        if isinstance(value, PackedWeight):
            entries[name] = {"kind": "packed", "shape": list(value.shape), "bits": value.bits, "group": value.group,
                             "zero": value.packed.zero}
            fields = {field: getattr(value.packed, field) for field in PACKED_BUFFERS}
        elif isinstance(value, GroupQuant):
            entries[name] = {"kind": "quant", "group": value.group, "bits": value.bits,
                             "super_group": value.super_group}
            fields = {field: getattr(value, field) for field in _QUANT_FIELDS}
        else:
            entries[name] = {"kind": "tensor"}
            fields = {None: value}
        for field, tensor in fields.items():
            if tensor is not None:
                arrays[name if field is None else f"{name}:{field}"] = tensor.detach().numpy()
    size = sum(array.nbytes for array in arrays.values())
    try:
        folder = ensure_cache_dir(file.parent)
        if shutil.disk_usage(folder).free < 2 * size + (1 << 30):
            log.info("not keeping packed weights (%d MB): too little free disk in %s", size >> 20, folder)
            return
        _write(file, arrays, {"weights": json.dumps(entries), "source": str(source.resolve()), "code": _CODE})
        # readable as the folder is (the writer leaves 0600: other users of a shared cache decoded), written by us
        file.chmod(folder.stat().st_mode & 0o444 | 0o200)
    except (OSError, CacheDirError, SafetensorError) as error:  # (safetensors reports a full disk as its own)
        warnings.warn(f"could not keep the packed weights at {file} ({error}); the next load decodes again",
                      RuntimeWarning, stacklevel=3)
        return
    log.debug("packed weights kept in %s (%d MB)", file, size >> 20)
    stem = file.name.rsplit("-", 1)[0]
    for stale in [*folder.glob("*.partial"), *folder.glob(".tmp*")]:  # a killed write's (safetensors' own .tmp*)
        try:
            if time.time() - stale.stat().st_mtime > STALE_WRITE_S:
                stale.unlink(missing_ok=True)
        except OSError:
            pass
    # this install's older files of this model (two installs sharing a cache, a release and a dev tree, removed
    # each other's on every load), any file of a checkpoint now gone, and the unreadable
    for other in folder.glob("*.safetensors"):
        if other == file:
            continue
        meta = _metadata(other)
        ours = other.name.startswith(f"{stem}-") and meta.get("code", _CODE) == _CODE
        if ours or not Path(meta.get("source", "")).is_file():
            other.unlink(missing_ok=True)


def _metadata(file: Path) -> dict[str, str]:
    """A packed file's metadata ({} where unreadable: as good as gone, unless it is another user's)."""
    from safetensors import safe_open

    if not os.access(file, os.R_OK):
        return {"source": str(file), "code": ""}  # (another user's: kept)
    try:
        with safe_open(file, framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # noqa: BLE001
        return {}


def _write(file: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    partial = file.with_name(f"{file.name}.{os.getpid()}.{threading.get_ident()}.partial")  # never half a file
    try:
        save_file(arrays, partial, metadata=metadata)
        os.replace(partial, file)
    finally:
        partial.unlink(missing_ok=True)


def _state(model: Transformer) -> Weights | None:
    """The weights ``model``'s constructor would need to make it again, by their state-dict names."""
    state: Weights = {}
    for prefix, module in model.named_modules():
        name = f"{prefix}.weight"
        if isinstance(module, QuantLinear):
            if not module.fast:
                return None
            state[name] = module.packed_weight()
            if module.bias is not None:
                state[f"{prefix}.bias"] = module.bias
        elif isinstance(module, QuantEmbedding):
            state[name] = module.quant
        elif isinstance(module, RMSNorm | nn.Embedding):
            state[name] = module.weight
        elif next(module.parameters(recurse=False), None) is not None or any(
                buffer not in module._non_persistent_buffers_set for buffer, _ in module.named_buffers(recurse=False)):
            return None  # a layer holding weights of another kind
    return state


def _rebuilt(name: str, entry: dict, tensors: dict[str, torch.Tensor]) -> torch.Tensor | GroupQuant | PackedWeight:
    if entry["kind"] == "tensor":
        return tensors[name]
    if entry["kind"] == "quant":
        fields = [tensors.get(f"{name}:{field}") for field in _QUANT_FIELDS]
        return GroupQuant(*fields[:3], entry["group"], entry["bits"], *fields[3:], entry["super_group"])
    packed = kernels.PackedQuant(*(tensors.get(f"{name}:{field}") for field in PACKED_BUFFERS), entry["zero"])
    return PackedWeight(packed, tuple(entry["shape"]), entry["bits"], entry["group"])


def _folder() -> Path:
    return cache_dir() / "packed"


def _stem(gguf: Path) -> str:
    """The model folder's name and its path's digest: one model's files, whatever code or CPU wrote them."""
    where = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:8]
    return f"{gguf.parent.name}-{where}"
