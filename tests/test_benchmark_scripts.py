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


def test_batching_sweep_configs_carry_method_options():
    namespace = runpy.run_path(str(SCRIPTS[0].parent / "batching.py"), run_name="benchmark_import_check")
    assert namespace["parse_config"]("ss:fixed:tree_k=1") == ("ss", "fixed", {"tree_k": "1"})
    assert namespace["parse_config"]("ar:fixed") == ("ar", "fixed", {})
