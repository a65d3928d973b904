"""Every script under benchmarks/ still imports: they reach into the package, and a moved name must not break one
silently (bench_linear.py did once)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

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


def test_draft_calibration_walks_sd_steps_under_the_confidence_rule():
    namespace = runpy.run_path(str(SCRIPTS[0].parent / "draft_calibration.py"), run_name="benchmark_import_check")
    # A prompt position, then four answer positions: sure, sure, unsure, wrong.
    window = ([0.1, 0.9, 0.9, 0.5, 0.9], [False, True, True, True, False], [False, True, True, True, True])
    # At 0.6 the third answer token ends the window (drafted, accepted): 3 accepted + the target's token.
    assert namespace["trajectories"]([window], 0.6) == {"mat": 4.0, "drafted": 3.0, "accepted_per_drafted": 1.0}
    # At 0.4 the draft goes on and also drafts the wrong fourth token.
    assert namespace["trajectories"]([window], 0.4) == {"mat": 4.0, "drafted": 4.0, "accepted_per_drafted": 0.75}
    top, right, written = (torch.tensor(values) for values in window)
    assert namespace["calibration"](top, right, written, 0.6) == {"sure": 0.75, "sure_agreement": 0.6667}
