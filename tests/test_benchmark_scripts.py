"""Every script under benchmarks/ still imports: they reach into the package, and a moved name must not break one
silently (bench_linear.py did once)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))


def test_there_are_benchmark_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports(script: Path):
    """Runs the module body (its imports and definitions) without its ``__main__`` block."""
    namespace = runpy.run_path(str(script), run_name="benchmark_import_check")
    assert callable(namespace.get("main")), f"{script.name} has no main()"
