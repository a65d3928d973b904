"""The kernel build lock: a killed build never blocks a later run, a waiting run says so, and build folders are
keyed by everything that makes the binary differ.

The builds here compile a one-function C++ file through the same :func:`mirrorsd.kernels.build_extension` the
real kernels use, with ``$CXX`` pointing at a wrapper that can stall, so a build can be killed midway."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mirrorsd import kernels

pytestmark = pytest.mark.skipif(shutil.which("c++") is None or not hasattr(os, "killpg"),
                                reason="needs a C++ compiler and POSIX process groups")

SOURCE = 'extern "C" int mirrorsd_probe() { return 7; }\n'
BUILD = """
import ctypes, sys
from pathlib import Path
from mirrorsd.kernels import build_extension
build = Path(sys.argv[1])
build_extension("probe", build.parent / "probe.cpp", build)
print("probe", ctypes.CDLL(str(build / "probe.so")).mirrorsd_probe(), flush=True)
"""


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    (tmp_path / "probe.cpp").write_text(SOURCE)
    stall = tmp_path / "stall"
    wrapper = tmp_path / "slow-c++"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ -f {stall} ] && [ "$1" != "--version" ]; then touch {tmp_path}/compiling; sleep 120; fi
        exec c++ "$@"
        """))
    wrapper.chmod(0o755)
    env = {**os.environ, "CXX": str(wrapper)}
    return tmp_path, env


def _start(tmp: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD, str(tmp / "build")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_a_build_killed_midway_never_blocks_the_next(setup):
    """A holds the lock and is killed (SIGKILL, compiler and all) while B waits: B says whom it waits for, then
    builds as soon as A is gone, although A's torch lock file and half-built folder are still there."""
    tmp, env = setup
    (tmp / "stall").touch()
    a = _start(tmp, env)
    try:
        _wait_for(tmp / "compiling")
        assert (tmp / "build" / "lock").exists()  # torch's own lock, which alone would hang every later run
        (tmp / "stall").unlink()
        assert (tmp / "build" / "build.lock").read_text().startswith(f"pid {a.pid}")
        b = _start(tmp, env)
        ready, _, _ = select.select([b.stderr], [], [], 60)
        assert ready, "B neither waited nor built"
        first_line = b.stderr.readline()
        assert f"waiting for pid {a.pid}" in first_line, first_line
        assert b.poll() is None
    finally:
        os.killpg(a.pid, signal.SIGKILL)
        a.wait()
    started = time.monotonic()
    out, err = b.communicate(timeout=120)
    assert b.returncode == 0, err
    assert "probe 7" in out
    assert "building mirrorsd CPU kernels" in err
    assert time.monotonic() - started < 90
    assert (tmp / "build" / kernels.DONE_STAMP).exists()


def test_a_stale_torch_lock_from_a_dead_build_is_ignored(setup):
    """A leftover torch lock file (a build killed before our lock existed) no longer hangs a run, and a
    finished folder is reused without rebuilding."""
    tmp, env = setup
    build = tmp / "build"
    build.mkdir()
    (build / "lock").touch()
    first = subprocess.run([sys.executable, "-c", BUILD, str(build)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    assert "probe 7" in first.stdout
    again = subprocess.run([sys.executable, "-c", BUILD, str(build)], env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0 and "probe 7" in again.stdout
    assert "building" not in again.stderr  # reused, not rebuilt


def test_build_key_covers_compiler_flags_source_and_torch(tmp_path, monkeypatch):
    source = tmp_path / "a.cpp"
    source.write_text(SOURCE)
    base = kernels.build_key(source, ["-O3"], [])
    assert kernels.build_key(source, ["-O3"], []) == base
    assert kernels.build_key(source, ["-O2"], []) != base
    assert kernels.build_key(source, ["-O3"], ["-fopenmp"]) != base
    source.write_text(SOURCE + "// changed\n")
    assert kernels.build_key(source, ["-O3"], []) != base
    source.write_text(SOURCE)
    (tmp_path / "clone").mkdir()
    (tmp_path / "clone" / "a.cpp").write_text(SOURCE)  # the same code in another checkout (ninja records paths)
    assert kernels.build_key(tmp_path / "clone" / "a.cpp", ["-O3"], []) != base
    monkeypatch.setattr(kernels.torch, "__version__", "0.0.0-other")
    assert kernels.build_key(source, ["-O3"], []) != base
    monkeypatch.undo()
    wrapper = tmp_path / "other-c++"
    wrapper.write_text('#!/bin/sh\necho "another compiler 1.0"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    assert kernels.build_key(source, ["-O3"], []) != base
