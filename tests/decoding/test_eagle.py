"""``eagle``: the head decoding runs drafts what training unrolled, and the proposer's cache bookkeeping (catch-up on
accepted rows, chain rows dropped after each verdict) gives the chain a fresh head would draft from the committed
text. Losslessness is the conformance suite's (tests/decoding/test_conformance.py)."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import generate
from mirrorsd.decoding import RequestState
from mirrorsd.decoding.eagle import method as eagle_method
from mirrorsd.decoding.eagle import runtime
from mirrorsd.decoding.eagle.head import HEAD_CONFIG, HeadConfig, feature_layers, load_head
from mirrorsd.decoding.eagle.runtime import HeadRunner
from mirrorsd.train_eagle import target_features, unroll
from mirrorsd.training import Chunk
from tests.helpers import random_head, row_exact, tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return row_exact(tiny_hf("qwen2", layers=8, seed=1, attention_bias=True))


def test_the_runner_drafts_what_training_unrolled(target, monkeypatch):
    """With dense weights the runner's rows are the unroll's states: the same positions, tokens and fed-back
    states (to fp32 rounding of the C++ block against PyTorch's: 1e-4 of the states' scale, where a position off by
    one moves them by their whole scale)."""
    monkeypatch.setattr(runtime, "_weight", lambda w, target: w.detach().float())
    head = random_head(target, seed=3)
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1))
    features = target_features(target, Chunk(ids, 1))["features"].float()
    with torch.no_grad():
        states = unroll(head, target, features, ids, 3)
    runner = HeadRunner(target, head)
    for start in (0, 7, 15):
        cache = runner.new_cache(32)
        state, _ = runner.rows(ids[1:start + 2].tolist(), features[:start + 1], 0, cache, fed_back=False)
        for j in range(3):
            if j:
                state, _ = runner.rows([int(ids[start + 1 + j])], state, start + j, cache, fed_back=True)
            want = states[j][start]
            assert (state[0] - want).abs().max() <= 1e-4 * want.abs().max(), (start, j)


def test_each_chain_is_what_a_fresh_head_drafts_from_the_committed_text(target, monkeypatch):
    head = random_head(target, seed=1)
    seen: list[tuple[list[int], list[int]]] = []
    propose = eagle_method.HeadProposer.propose

    def recording(self, state):
        proposal = propose(self, state)
        seen.append((list(state.tokens), proposal.tokens))
        return proposal

    monkeypatch.setattr(eagle_method.HeadProposer, "propose", recording)
    out = generate(target, [3, 1, 4, 1, 5, 9, 2, 6], method="eagle", head=head, gamma=3, max_new_tokens=30)
    assert len(seen) == out.stats.steps and sum(out.stats.drafted) > 0
    runner = eagle_method.runner_for(target, head, 0)
    for committed, chain in seen:
        scorer = eagle_method.FeatureScorer(target)  # (batch-invariant, as decoding: the training cache is not)
        scorer.prefill(RequestState(None, committed, target.new_cache(capacity=64)))  # type: ignore[arg-type]
        features = scorer.features
        cache = runner.new_cache(64)
        state, token = runner.rows(committed[1:], features, 0, cache, fed_back=False)
        fresh = [token]
        while len(fresh) < len(chain):
            state, token = runner.rows([fresh[-1]], state, len(committed) - 2 + len(fresh), cache, fed_back=True)
            fresh.append(token)
        assert fresh == chain, committed


def test_a_head_saved_again_into_its_folder_is_read_again(target, tmp_path):
    """Runners were cached by the folder's path alone: a process evaluating successive checkpoints saved into one
    folder kept drafting with the first."""
    import os

    config, folder = HeadConfig("tiny", feature_layers(8), 64, 8, 3, {}), tmp_path / "head"
    config.save(folder, random_head(target, seed=2))
    first = eagle_method.runner_for(target, folder, 0)
    assert eagle_method.runner_for(target, str(folder), 0) is first  # (unchanged: the same runner)
    config.save(folder, random_head(target, seed=3))
    for f in folder.iterdir():  # (a later save, whatever the file system's clock granularity)
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    again = eagle_method.runner_for(target, folder, 0)
    x = torch.randn(1, first.fc.in_features)
    assert again is not first and not torch.equal(again.fc(x), first.fc(x))


def test_a_saved_head_loads_and_refuses_another_target(target, tmp_path):
    head = random_head(target, seed=2)
    HeadConfig("tiny", feature_layers(8), 64, 8, 3, {}).save(tmp_path / "head", head)
    loaded = load_head(target, tmp_path / "head")
    for (name, want), got in zip(head.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(want, got), name
    other = row_exact(tiny_hf("qwen2", layers=6, seed=1, attention_bias=True))
    with pytest.raises(ValueError, match="trained for tiny"):
        load_head(other, tmp_path / "head")
    with pytest.raises(FileNotFoundError, match=HEAD_CONFIG):
        load_head(target, tmp_path)
    with pytest.raises(ValueError, match="head.*required"):
        generate(target, [1, 2], method="eagle", max_new_tokens=2)


def test_the_heads_cache_holds_what_a_window_can_use(target, monkeypatch):
    """The head's cache was sized prompt + max_new + γ + 2: a request's gamma=10**12 asked for 128 TB (a server's
    500). A window never drafts past the tokens left, so γ counts up to max_new only."""
    capacities = []
    new_cache = HeadRunner.new_cache
    monkeypatch.setattr(HeadRunner, "new_cache", lambda self, capacity: capacities.append(capacity)
                        or new_cache(self, capacity))
    prompt, head = [3, 1, 4, 1, 5, 9, 2, 6], random_head(target, seed=1)
    out = generate(target, prompt, method="eagle", head=head, gamma=10**12, max_new_tokens=12)
    assert out.token_ids == generate(target, prompt, method="ar", max_new_tokens=12).token_ids
    assert capacities == [len(prompt) + 12 + 12 + 2]
    generate(target, prompt, method="eagle", head=head, gamma=3, max_new_tokens=12)
    assert capacities[-1] == len(prompt) + 12 + 3 + 2  # (a window of γ = 3 as before)


def test_serve_refuses_eagle_without_a_head_before_loading_anything(monkeypatch, capsys):
    """A head is the server's to give (a request cannot): `mirrorsd serve --method eagle` without --head started,
    after loading the models, and failed every request."""
    import mirrorsd
    from mirrorsd.cli import main

    monkeypatch.setattr(mirrorsd, "load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))
    assert main(["serve", "--target", "smollm2-135m", "--method", "eagle", "--no-warmup"]) == 2
    assert "--head is required: a folder from `mirrorsd train-eagle` (--head FOLDER)" in capsys.readouterr().err


def test_a_head_builds_and_drafts_for_a_bfloat16_target():
    """A bfloat16 target (a GPU's usual one): the head read its projections with float32 inputs and its runner kept
    float32 norms beside bfloat16 projections; both failed in a matmul."""
    from mirrorsd import Transformer

    target = Transformer.from_hf(tiny_hf("qwen2", layers=4, seed=1).to(torch.bfloat16))
    runner = HeadRunner(target, random_head(target, seed=3))
    features = torch.randn(3, 3 * target.config.hidden_size, dtype=torch.bfloat16)
    state, token = runner.rows([1, 2, 3], features, 0, runner.new_cache(32), fed_back=False)
    assert state.dtype == torch.bfloat16 and 0 <= token < target.config.vocab_size
