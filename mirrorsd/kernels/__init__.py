"""CPU kernels for small-M linears and batch-invariant attention: an AVX-512/VNNI C++ extension built on first use,
with PyTorch fallbacks.

The extension (``cpu_linear.cpp``, ``cpu_attention.cpp``, ``cpu_elementwise.cpp``, and ``cpu_block.cpp``, which
runs a quantized model's whole decoder block in one call) is compiled once into
``<cache>/kernels/<key>``, where the key hashes everything that makes the binary differ: the sources, the flags, the
torch version and install path, the Python ABI and the compiler (path and ``--version``). Builds are serialised by
an OS file lock, which the kernel drops when its holder dies (Ctrl-C, OOM, a closed terminal), so a killed build can
never block a later run; a run that waits for a live build says so. Where the extension cannot be built or run (no
compiler, a CPU without AVX-512 VNNI, ``MIRRORSD_KERNELS=off``) :func:`available` is False, a one-line warning says
why, and the pure-PyTorch functions below compute the same model more slowly.

Packed layouts (see the C++ file for the why): weights are interleaved in blocks of 16 output features so one vector
load feeds 16 outputs and every activation row reuses it from registers.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..cache import CacheDirError, cache_dir, ensure_cache_dir
from ..quant import GroupQuant

log = logging.getLogger(__name__)

BLOCK_N = 16
ACT_GROUP = 32
#: Smallest normal float32: an activation group below it quantizes to zeros (127 / subnormal overflows).
FLT_MIN = torch.finfo(torch.float32).tiny
#: (packed code bits, group size) pairs the C++ kernel implements: Q4_x/Q4_K (4), Q5_0/Q5_K (5), Q6_K (6/16),
#: Q8_0 and our q8 (8).
LAYOUTS = ((4, 32), (5, 32), (6, 32), (6, 16), (8, 32), (8, 16))
#: How often a run waiting for another process's build says it is still waiting.
WAIT_MESSAGE_EVERY_S = 15.0
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_linear.cpp", "cpu_attention.cpp",
                                                              "cpu_elementwise.cpp", "cpu_block.cpp"))
#: Headers the sources include: part of the build key, not compiled on their own.
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_kernels.h", "cpu_avx2.h"))
EXTENSION = "mirrorsd_cpu_linear"
#: The instruction sets the kernels build for, best first: the /proc/cpuinfo flags each needs and its compiler
#: flags. The sources are written in AVX-512 (+VNNI); on AVX2 CPUs cpu_avx2.h runs them on pairs of 256-bit
#: registers, with the same bits.
ISAS = {
    # AMX-INT8 tiles for multi-row calls (Sapphire Rapids and later); one-row calls stay on the VNNI code.
    "avx512-amx": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma", "amx_tile", "amx_int8"),
                   ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma", "-mamx-tile",
                    "-mamx-int8"]),
    "avx512-vnni": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"),
                    ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]),
    "avx2": (("avx2", "f16c", "fma"), ["-mavx2", "-mf16c", "-mfma"]),
}
# -fopenmp: at::parallel_for is a header template that splits work with OpenMP pragmas; without the flag it
# silently runs on one thread. The module then binds to the libgomp torch already loaded (same soname).
LINK_FLAGS = ["-fopenmp"]
#: Written into a build folder after its library loaded: a folder with a library but no stamp was cut off
#: mid-build (a killed linker can leave a truncated .so that ninja would call up to date) and is rebuilt.
DONE_STAMP = "built.ok"


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


#: Linux's arch_prctl(2) request for an extended-state component, and AMX's tile data component: a process must ask
#: before its first tile instruction (the kernel then saves the 8 KB of tiles on context switches).
SYS_ARCH_PRCTL = 158
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@cache
def _amx_denied() -> str | None:
    """Ask Linux once per process for the AMX tile state: None when granted, else why not (a one-line warning then
    says the kernels run their VNNI build)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0:
            return None
        reason = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        reason = repr(exc)
    warnings.warn(f"mirrorsd: Linux refused AMX tile state (arch_prctl XTILEDATA: {reason}); using the "
                  "avx512-vnni kernels", RuntimeWarning, stacklevel=3)
    return reason


def usable_isas() -> list[str]:
    """The :data:`ISAS` this CPU (and, for AMX, Linux) lets this process run, best first."""
    flags = _cpu_flags()
    usable = [name for name, (needs, _) in ISAS.items() if all(f in flags for f in needs)]
    if "avx512-amx" in usable and platform.system() == "Linux" and _amx_denied() is not None:
        usable.remove("avx512-amx")
    return usable


def isa() -> str | None:
    """The best instruction set in :data:`ISAS` this CPU has, or None; ``MIRRORSD_KERNEL_ISA`` forces one of those
    it can run (``avx2`` on an AVX-512 CPU, ``avx512-vnni`` on an AMX one: to compare the builds)."""
    usable = usable_isas()
    wanted = os.environ.get("MIRRORSD_KERNEL_ISA")
    if wanted:
        if wanted not in usable:
            raise RuntimeError(f"MIRRORSD_KERNEL_ISA={wanted}: this CPU runs {usable or 'none'} of {list(ISAS)}")
        return wanted
    return usable[0] if usable else None


def has_bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX): without it PyTorch's bf16 GEMMs convert
    to fp32 in software and run ~3x slower than fp32 ones (16 against 5.2 s a stream-training step on a 2-core
    AVX-512 Xeon without it)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def compile_flags(name: str) -> list[str]:
    return ["-O3", *ISAS[name][1], "-std=c++17", "-fopenmp"]


def _switched_off() -> str | None:
    """Why the kernels must not run whatever the CPU, or None."""
    if os.environ.get("MIRRORSD_KERNELS", "").lower() in {"0", "off", "false", "no"}:
        return "disabled by MIRRORSD_KERNELS"
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"needs x86-64, this is {platform.machine()}"
    return None


def _why_unavailable() -> str | None:
    if (off := _switched_off()) is not None:
        return off
    if missing := [path.name for path in (*SOURCES, *HEADERS) if not path.is_file()]:  # (a wheel built without them)
        return f"{', '.join(missing)} missing from {Path(__file__).parent}: an incomplete install (reinstall mirrorsd)"
    if isa() is None:
        return f"this CPU lacks {', '.join(f for f in ISAS['avx2'][0] if f not in _cpu_flags())} (AVX2 at least)"
    return None


def isa_label() -> str:
    """The kernel build this machine runs (an :data:`ISAS` name), or "off" where they cannot or must not run, found
    without building anything: a plan's machine label asks before a model loads."""
    try:
        return "off" if _why_unavailable() else str(isa())
    except RuntimeError:  # MIRRORSD_KERNEL_ISA names a build this CPU cannot run: loading will say so
        return "off"


def _compiler_identity() -> str:
    """The C++ compiler torch will call (``$CXX`` or ``c++``): its resolved path and ``--version`` banner."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx) or cxx
    try:
        banner = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        banner = f"unavailable: {exc!r}"
    return f"{os.path.realpath(path)}\n{banner}"


def _paths(sources: Path | Sequence[Path]) -> list[Path]:
    return [sources] if isinstance(sources, Path) else list(sources)


def build_key(sources: Path | Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """A hash of everything that makes the built library differ (two environments never share a folder). The
    sources' paths too: ninja's build file names them, so two checkouts of the same code sharing a folder rebuilt
    each other's library on every switch (minutes, under the lock the other waited on)."""
    parts = [*(source.read_bytes() for source in _paths(sources)),
             *(str(source.resolve()).encode() for source in _paths(sources)), " ".join(cflags).encode(),
             " ".join(ldflags).encode(), torch.__version__.encode(),
             str(Path(torch.__file__).resolve().parent).encode(), sys.version.encode(),
             str(sysconfig.get_config_var("EXT_SUFFIX")).encode(), platform.machine().encode(),
             _compiler_identity().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@contextlib.contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """Hold ``build``'s OS file lock, saying who we wait for while another live process builds there.

    The lock is an ``flock`` on ``build/build.lock``: the kernel releases it when its holder exits in any way,
    so it cannot outlive a killed build. torch's own lock file (``build/lock``, judged only by existence) can
    then only be a leftover and is removed before building."""
    import fcntl

    build.mkdir(parents=True, exist_ok=True)
    with open(build / "build.lock", "a+") as fh:
        started = time.monotonic()
        said = None
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - started
                if said is None or waited - said >= WAIT_MESSAGE_EVERY_S:
                    fh.seek(0)
                    holder = fh.read().strip() or "another process"
                    log.warning("waiting for %s, which is building mirrorsd CPU kernels in %s (%.0f s so far)",
                                holder, build, waited)
                    said = waited
                time.sleep(0.2)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} on {platform.node()}")
            fh.flush()
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ninja_on_path() -> None:
    """torch runs the bare ``ninja``, and the ``ninja`` package (our dependency) puts it in its environment's bin
    folder, which is not on ``PATH`` where that environment is not activated (its ``mirrorsd`` run by its path,
    pipx, a service unit): the build then failed with "pip install ninja" advice, and decoding ran ~20x slower."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def build_extension(name: str, sources: Path | Sequence[Path], build: Path, cflags: Sequence[str] = (),
                    ldflags: Sequence[str] = ()) -> None:
    """Compile (if needed) and load a C++ extension into ``build`` under :func:`build_lock`."""
    from torch.utils import cpp_extension

    ninja_on_path()
    with build_lock(build):
        done = build / DONE_STAMP
        if not done.exists():
            for leftover in build.iterdir():  # a build cut off midway: start clean, keep only our lock
                if leftover.name != "build.lock":
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            log.warning("building mirrorsd CPU kernels once into %s (~20 s)", build)
        cpp_extension.load(name=name, sources=[str(source) for source in _paths(sources)],
                           extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                           build_directory=str(build), is_python_module=False, verbose=False)
        done.touch()


def build_dir(name: str) -> Path:
    return cache_dir() / "kernels" / build_key((*SOURCES, *HEADERS), compile_flags(name), LINK_FLAGS)


@cache
def _load() -> str | None:
    """Build (once) and load the C++ kernels: None when loaded, else why not."""
    reason = _why_unavailable()
    if reason is None:
        name = isa()
        built = build_dir(name)
        if (built / DONE_STAMP).exists() and not os.access(built, os.W_OK):
            # a finished build in a cache this user cannot write (a read-only image, another user's cache): load
            # it as it is (the PyTorch fallbacks decoded ~22x slower)
            try:
                torch.ops.load_library(str(built / f"{EXTENSION}.so"))
                return None
            except Exception as exc:  # noqa: BLE001 - then as any unwritable cache: fall back, saying why
                return f"the {name} C++ extension in the read-only {built} failed to load: {exc}"
        try:
            build_extension(EXTENSION, SOURCES, ensure_cache_dir(build_dir(name)), compile_flags(name), LINK_FLAGS)
            return None
        except CacheDirError as exc:  # nowhere to build: fall back, saying which variable to fix
            reason = str(exc)
        except Exception as exc:  # a compiler error, missing ninja, ...: fall back, but say so
            detail = build_failure(exc)
            reason = f"the {name} C++ extension failed to build in {build_dir(name)}: {detail}"
    return reason


def build_failure(exc: Exception) -> str:
    """What a failed build's exception says that a user can act on: torch's message is ninja's whole log, whose last
    line is always "ninja: build stopped: subcommand failed."; the compiler's own ``error:`` lines say why."""
    text = str(exc).strip()
    if not text:
        return repr(exc)
    lines = text.splitlines()
    errors = list(dict.fromkeys(line.strip() for line in lines if "error:" in line or "fatal error" in line))
    return "; ".join(errors[:3]) if errors else lines[-1]


@cache
def available() -> bool:
    """Build (once) and load the C++ kernels; False, with one warning saying why, when that is impossible."""
    reason = _load()
    if reason is not None:
        warnings.warn(f"mirrorsd fast CPU kernels unavailable ({reason}); using slower PyTorch fallbacks",
                      RuntimeWarning, stacklevel=2)
    return reason is None


def ops() -> torch._ops._OpNamespace:
    """``torch.ops.mirrorsd``, loading (and on first use building) the extension: every entry point below goes
    through here, so a fresh process may call any of them first. Where the kernels cannot run, the error says why
    (the ISA and the build) instead of torch's bare missing-attribute error."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"mirrorsd CPU kernels cannot run here (kernel build {isa_label()!r}: {reason}); "
                           "callers check kernels.available() and take the PyTorch fallbacks")
    return torch.ops.mirrorsd


# ---------------------------------------------------------------- packing


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % BLOCK_N
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` fp32 → ``[N/16, K, 16]`` (rows padded with zeros)."""
    w = _pad_rows(weight.float())
    return w.reshape(-1, BLOCK_N, w.shape[1]).transpose(1, 2).contiguous()


def set_amx_min_rows(rows: int) -> int:
    """Send calls from ``rows`` quantized rows on through AMX tiles (default: the measured crossover); returns the
    previous threshold, or -1 where the build has no AMX. For measurements and the bit tests, which force 1."""
    return int(ops().set_amx_min_rows(rows))


def code_widths() -> tuple[int, ...]:
    """The code widths weights are packed at on this CPU, narrowest first. AVX2 has no byte-masked add to put 5/6-bit
    codes' high bits back from their planes (it takes ~14 instructions per 32 codes instead of one), so there they
    stay whole bytes: a third more weight bytes, several times fewer instructions."""
    try:
        name = isa()
    except RuntimeError:  # MIRRORSD_KERNEL_ISA names a build this CPU cannot run: only loading the kernels cares
        if _switched_off() is None:
            raise
        name = (usable_isas() or [None])[0]
    return (4, 8) if name == "avx2" else (4, 5, 6, 8)


def packed_bits(q: GroupQuant) -> int:
    """The narrowest kernel code width holding every code: GGUF's Q5_0/Q6_K say 8 bits but need 5/6."""
    needed = max(int(q.codes.max()).bit_length(), 1) if q.codes.numel() else 1
    return next(b for b in code_widths() if needed <= b and (b, q.group) in LAYOUTS)


class PackedQuant(NamedTuple):
    """A GroupQuant in the kernel layout (``cpu_linear.cpp``).

    ``scales``/``offsets`` ``[N/16, K/G, 16]``: fp16, or int8 sub-scales with fp16 ``super_scales``/``super_offsets``
    ``[N/16, K/S, 16]`` (two-level, the K-quants). ``offsets`` None with ``zero`` Z > 0: a symmetric format
    (offset = -Z·scale, see :func:`symmetric_zero`), whose zero point the kernel takes in the integer dot."""

    codes: torch.Tensor
    planes: torch.Tensor | None
    scales: torch.Tensor
    offsets: torch.Tensor | None
    super_scales: torch.Tensor | None
    super_offsets: torch.Tensor | None
    zero: int


#: (bits, group) layouts with two-level scales in the kernel: Q4_K, Q5_K, Q6_K, and Q5_K/Q6_K in whole bytes
#: (:func:`code_widths`). Two-level scales are the K-quants', whose codes stay below 64: the kernel relies on it.
TWO_LEVEL_LAYOUTS = ((4, 32), (5, 32), (6, 16), (8, 32), (8, 16))
#: Codes of a two-level weight stay below this (6 bits): the kernel bounds its AVX2 int16 pair sums by it.
TWO_LEVEL_CODE_LIMIT = 64


def _sub_scales(values: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """int8 ``i`` with ``supers · i == values`` exactly in fp32 (supers fp16-exact): a K-quant's integer sub-scales."""
    per_super = values.shape[1] // supers.shape[1]
    expanded = supers.repeat_interleave(per_super, dim=1)
    sub = torch.where(expanded != 0, values / torch.where(expanded != 0, expanded, 1), 0).round()
    if not (torch.equal(supers.half().float(), supers) and bool(((sub >= -128) & (sub <= 127)).all())
            and torch.equal(expanded * sub, values)):
        raise ValueError("two-level scales must be fp16 super values times int8 integers, exactly")
    return sub.to(torch.int8)


def uses_two_level(q: GroupQuant, bits: int) -> bool:
    """Whether ``q`` packed at ``bits`` keeps its two-level scales (the kernel then uses them exactly, not as fp16).
    Whole-byte codes keep them only below :data:`TWO_LEVEL_CODE_LIMIT`, which the kernel's AVX2 sums rely on."""
    if q.super_scales is None or (bits, q.group) not in TWO_LEVEL_LAYOUTS:
        return False
    return bits != 8 or not q.codes.numel() or int(q.codes.max()) < TWO_LEVEL_CODE_LIMIT


def _bit_planes(steps: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., 64]`` → int64 ``[..., bits - 4]``: plane ``b`` holds bit ``4 + b`` of code ``i`` at bit
    ``i``. Packed a byte at a time (numpy's packbits, little-endian), so no int64 copy of the codes is made: a
    151,936 × 1,536 Q6_K head would otherwise allocate 1.9 GB per plane and take seconds to load."""
    high = (steps >> 4).numpy()
    planes = [np.packbits((high >> b) & 1, axis=-1, bitorder="little").view(np.int64) for b in range(bits - 4)]
    return torch.from_numpy(np.concatenate(planes, axis=-1))


def pack_quant(q: GroupQuant, bits: int | None = None, two_level: bool = True) -> PackedQuant:
    """GroupQuant → :class:`PackedQuant` for ``bits``-bit codes (default: :func:`packed_bits`).

    One-level scales/offsets become fp16 (halving their bytes): exact for Q8_0/Q5_0/Q4_0/Q4_1 and our q8. K-quants
    (with ``two_level``) keep GGUF's own split, an int8 per group times an fp16 per 256 weights, which is both
    lighter and exact; otherwise their products d·sc round to fp16 (relative 2^-11). Symmetric offsets are dropped."""
    bits = packed_bits(q) if bits is None else bits
    n, k = q.shape
    codes = _pad_rows(q.codes)
    blocks = codes.shape[0] // BLOCK_N
    steps = codes.view(blocks, BLOCK_N, k // 4, 4).transpose(1, 2).reshape(blocks, k // 4, BLOCK_N * 4)
    planes = None
    if bits == 8:
        packed = steps
    else:  # low nibbles of step pairs share a byte; bits 4.. go to 64-bit planes, one bit per code byte
        pairs = (steps & 0x0F).reshape(blocks, k // 8, 2, BLOCK_N * 4)
        packed = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        planes = _bit_planes(steps, bits) if bits > 4 else None
    def interleave(t: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        t = _pad_rows(t).to(dtype)
        return t.view(blocks, BLOCK_N, t.shape[1]).transpose(1, 2).contiguous()

    zero = symmetric_zero(q)
    if two_level and uses_two_level(q, bits):
        if not zero and q.super_offsets is None:
            raise ValueError("two-level scales with offsets need super_offsets")
        return PackedQuant(packed.contiguous(), planes, interleave(_sub_scales(q.scales, q.super_scales), torch.int8),
                           None if zero else interleave(_sub_scales(q.offsets, q.super_offsets), torch.int8),
                           interleave(q.super_scales), None if zero else interleave(q.super_offsets), zero)
    return PackedQuant(packed.contiguous(), planes, interleave(q.scales), None if zero else interleave(q.offsets),
                       None, None, zero)


#: Zero points of the symmetric formats (offset = -Z * scale): Q4_0, Q5_0, Q6_K, Q8_0 and our q8.
SYMMETRIC_ZEROS = (8, 16, 32, 128)


def symmetric_zero(q: GroupQuant) -> int:
    """The Z with fp16(offset) == -Z * fp16(scale) bit for bit in every group, else 0 (offsets must be kept).

    The kernel then forms each offset from its fp16 scale (a power-of-two product: exact), so dropping the offsets
    changes no result bit and the weight stream loses 2 bytes per group."""
    scales, offsets = q.scales.half(), q.offsets.half().view(torch.int16)
    for zero in SYMMETRIC_ZEROS:
        if torch.equal((scales.float() * -zero).half().view(torch.int16), offsets):
            return zero
    return 0


# ---------------------------------------------------------------- reference math (also the fallbacks)


def _quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = groups.abs().amax(-1)
    # A tensor divided by a tensor: ``127.0 / amax`` is ATen's ``amax.reciprocal() * 127``, which rounds differently
    # from the kernel's 127 / amax and can move a product off a half-way tie (one int8 step). 127 / subnormal: inf,
    # hence the guard.
    inv = torch.where(amax >= FLT_MIN, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(groups * inv[..., None]), amax / 127.0


def quantize_activations(x: torch.Tensor, split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-32 absmax int8 quantization, exactly as the kernel does it: (codes as fp32, scales).

    ``split``: rows ``2m`` and ``2m + 1`` are row m's codes and the codes of its remainder ``x - codes * scale``
    (two int8 planes, ~15-bit activations; the product of a row is the sum of its two rows' products)."""
    m, k = x.shape
    groups = x.view(m, k // ACT_GROUP, ACT_GROUP)
    codes, scales = _quantize_groups(groups)
    if split:
        rest_codes, rest_scales = _quantize_groups(groups - codes * scales[..., None])
        codes, scales = torch.stack([codes, rest_codes], 1), torch.stack([scales, rest_scales], 1)
        m *= 2
    return codes.reshape(m, k), scales.reshape(m, k // ACT_GROUP)


def linear_quant_reference(x: torch.Tensor, q: GroupQuant, bias: torch.Tensor | None = None,
                           chunk: int = 4096, split: bool = False) -> torch.Tensor:
    """The quantized layer in plain PyTorch: int8 activations (two planes with ``split``), exact integer group
    dots, fp16 scales."""
    m, k = x.shape
    n = q.shape[0]
    xq, xs = quantize_activations(x.float(), split)
    rows = xq.shape[0]
    groups = k // q.group
    xg = xq.view(rows, groups, q.group)
    xs_g = xs.repeat_interleave(ACT_GROUP // q.group, dim=1) if q.group < ACT_GROUP else xs
    xsum = xs_g * xg.sum(-1)
    two_level = uses_two_level(q, packed_bits(q))
    sw = q.scales if two_level else q.scales.half().float()
    ow = q.offsets if two_level else q.offsets.half().float()
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        codes = q.codes[start:stop].view(stop - start, groups, q.group).float()
        # (contiguous: einsum hands the group dimension back outermost, and a sum over that strided dimension
        # groups its terms by how many rows share the call: a row's bits would depend on its batch)
        dots = torch.einsum("mgk,ngk->mng", xg, codes).contiguous()
        out[:, start:stop] = (dots * sw[start:stop] * xs_g[:, None]).sum(-1) + (ow[start:stop] * xsum[:, None]).sum(-1)
    if split:
        out = out.view(m, 2, n).sum(1)
    return out if bias is None else out + bias


# ---------------------------------------------------------------- kernel entry points


def linear_f32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return ops().linear_f32(x, packed, bias, n)


def linear_quant(x: torch.Tensor, packed: PackedQuant, bias: torch.Tensor | None, n: int, bits: int, group: int,
                 split: bool = False) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` for a weight packed by :func:`pack_quant` (int8 activations; two planes with
    ``split``)."""
    return ops().linear_quant(x, packed.codes, packed.planes, packed.scales, packed.offsets,
                             packed.super_scales, packed.super_offsets, bias, n, bits, group, split, packed.zero)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Batch-invariant attention (``cpu_attention.cpp``): every query exactly as a one-query call computes it.

    ``q`` ``[rows, heads, T, dim]``; ``k``/``v`` ``[rows, kv_heads, S, dim]``; ``mask`` bool ``[rows or 1, T, S]``
    or None for causal over a cache ending in the queries' own keys."""
    return ops().attend(q, k, v, None if mask is None else mask.contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one call (``cpu_elementwise.cpp``), row-local."""
    return ops().rms_norm(x.contiguous(), weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one call (``cpu_elementwise.cpp``), with the fused block's exp: the same bits."""
    return ops().silu_mul(gate, up)


def lora_delta(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scale: float) -> torch.Tensor:
    """``((x a^T) b^T) · scale`` over ``x``'s last dimension, given ``bt`` = b^T ``[rank, out]``, fp32
    (``cpu_elementwise.cpp``), row-local: a LoRA adapter's delta as the C++ blocks add it to Speculative Streaming's
    stream rows."""
    return ops().lora_delta(x.contiguous(), a.contiguous(), bt.contiguous(), scale)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[rows, T, heads, dim]`` with ``cos``/``sin`` ``[rows or 1, T, dim]``, returned
    as ``[rows, heads, T, dim]`` (attention's layout) in one call."""
    return ops().rope(x.contiguous(), cos.contiguous(), sin.contiguous())
