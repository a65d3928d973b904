"""The trainers' shared loop: a run stopped at any step resumes to exactly the run that was never stopped."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from mirrorsd.training import CURVE, Trainable, fit


class Stop(Exception):
    pass


def _run(out, steps: int, stop_at: int | None = None, save_every: int = 1,
         interrupt: type[BaseException] | None = Stop, signal_at_eval: int | None = None
         ) -> tuple[torch.nn.Linear, dict]:
    """``interrupt`` None: a real SIGINT (Ctrl-C) arrives in the middle of step ``stop_at`` (or of evaluation
    number ``signal_at_eval``)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [torch.randn(8, 4) for _ in range(3)]
    targets = [x.sum(-1, keepdim=True) for x in data]
    calls = {"n": 0}

    def step(i: int):
        calls["n"] += 1
        if i == 2:  # a window with nothing to learn: the schedule moves, the weights do not
            return None, 0, {}
        loss = torch.nn.functional.mse_loss(model(data[i]), targets[i])
        if stop_at is not None and calls["n"] == stop_at:
            if interrupt is None:
                signal.raise_signal(signal.SIGINT)  # (the step goes on: Ctrl-C waits for its end)
            else:
                raise interrupt
        return loss, 8, {"mse": f"{loss.item():.3f}"}

    evaluations = {"n": 0}

    def evaluate() -> dict:
        evaluations["n"] += 1
        if evaluations["n"] == signal_at_eval:
            signal.raise_signal(signal.SIGINT)
        with torch.no_grad():
            return {"mse": sum(torch.nn.functional.mse_loss(model(x), y).item()
                               for x, y in zip(data, targets, strict=True))}

    trainable = Trainable(list(model.parameters()), model.state_dict, model.load_state_dict, "linear")
    try:
        fitted = fit(out, trainable, [0, 1, 2], step, evaluate, steps=steps, lr=0.05, seed=3, eval_every=2,
                     save_every=save_every, desc="test", progress=False)
    except (Stop, KeyboardInterrupt):
        return model, {}
    return model, {"curve": fitted.curve, "tokens": fitted.tokens}


def test_fit_resumes_to_the_run_that_was_never_stopped(tmp_path):
    whole, done = _run(tmp_path / "whole", 7)
    _, stopped = _run(tmp_path / "resumed", 7, stop_at=5)  # stopped after 4 steps, each checkpointed
    assert not stopped
    resumed, done_again = _run(tmp_path / "resumed", 7)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert done_again == done
    # Seven steps over three windows, one of them empty: 7 - 2 visits of window 2 (epochs 0 and 1) = 5 x 8 tokens.
    assert done["tokens"] == 40
    assert [p["step"] for p in done["curve"]] == [0, 2, 4, 6, 7]
    assert done["curve"][-1]["mse"] < done["curve"][0]["mse"]
    assert json.loads((tmp_path / "whole" / CURVE).read_text()) == done["curve"]


def test_fit_with_zero_steps_only_evaluates(tmp_path):
    _, done = _run(tmp_path / "none", 0)
    assert done["tokens"] == 0 and [p["step"] for p in done["curve"]] == [0]


@pytest.mark.parametrize("stop_at", [1, 2])
def test_fit_stopped_before_its_first_checkpoint_starts_over(tmp_path, stop_at):
    _run(tmp_path / "x", 5, stop_at=stop_at)
    _, again = _run(tmp_path / "x", 5)
    _, fresh = _run(tmp_path / "y", 5)
    assert again == fresh


def test_ctrl_c_between_checkpoints_keeps_every_finished_step(tmp_path):
    """Checkpoints come every 25 steps; Ctrl-C at the fifth step still saves the four finished, and the resumed run
    is the run that was never stopped."""
    whole, done = _run(tmp_path / "whole", 7, save_every=25)
    _run(tmp_path / "resumed", 7, stop_at=5, save_every=25, interrupt=KeyboardInterrupt)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["step"] == 4
    resumed, done_again = _run(tmp_path / "resumed", 7, save_every=25)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert done_again == done


def test_ctrl_c_inside_a_step_takes_effect_after_it(tmp_path):
    """A real Ctrl-C in the middle of the fifth step: the step finishes (its update whole), is saved, and the run
    stops; the resumed run is the one never stopped. One in the last evaluation keeps that evaluation."""
    whole, done = _run(tmp_path / "whole", 7, save_every=25)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as in a terminal: xdist's workers ignore it)
    try:
        _ctrl_c_inside_a_step(tmp_path, whole, done)
    finally:
        signal.signal(signal.SIGINT, outer)


def _ctrl_c_inside_a_step(tmp_path, whole, done) -> None:
    handler = signal.getsignal(signal.SIGINT)
    assert _run(tmp_path / "resumed", 7, stop_at=5, save_every=25, interrupt=None)[1] == {}  # (stopped)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["step"] == 5
    assert signal.getsignal(signal.SIGINT) is handler  # (given back)
    resumed, done_again = _run(tmp_path / "resumed", 7, save_every=25)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert done_again == done
    assert _run(tmp_path / "last", 7, signal_at_eval=5)[1] == {}  # evaluations at steps 0, 2, 4, 6 and 7
    _, finished = _run(tmp_path / "last", 7)
    assert finished == done


@pytest.mark.parametrize("ctrl_c", ["handled", "ignored"])  # (ignored: a background job of a script)
def test_a_sigterm_inside_a_step_saves_it_and_stops(tmp_path, ctrl_c):
    """``kill`` (a job scheduler's stop) ended the process at once: every step since the last save was lost. It now
    stops as Ctrl-C does, after the step it came in, and saves."""
    model = torch.nn.Linear(4, 1)
    trainable = Trainable(list(model.parameters()), model.state_dict, model.load_state_dict, "linear")
    x = torch.ones(4)

    def step(i: int) -> tuple[torch.Tensor, int, dict]:
        if step.calls == 3:
            signal.raise_signal(signal.SIGTERM)
        step.calls += 1
        return model(x).square().sum(), 1, {}

    step.calls = 0
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    outer = signal.signal(signal.SIGINT, signal.default_int_handler if ctrl_c == "handled" else signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            fit(tmp_path / "out", trainable, [0, 1], step, dict, steps=20, lr=0.01, seed=0, eval_every=100,
                save_every=25, desc="test", progress=False)
        assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]  # (given back)
    finally:
        signal.signal(signal.SIGINT, outer)
    assert torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False)["step"] == 4  # (the step it came in)


def test_every_run_that_shaped_the_weights_is_recorded(tmp_path):
    """A run extended with more steps saved only its last command, which trains another run from scratch (the
    schedule had decayed to the first count)."""
    model = torch.nn.Linear(4, 1)
    trainable = Trainable(list(model.parameters()), model.state_dict, model.load_state_dict, "linear")
    run = lambda steps, command: fit(tmp_path / "out", trainable, [0, 1], lambda i: (model(torch.ones(4)).sum(), 1,  # noqa: E731
                                     {}), dict, steps=steps, lr=0.01, seed=0, eval_every=100, save_every=2,
                                     desc="test", progress=False, command=command)
    assert run(4, "train --steps 4").runs == [{"steps": [0, 4], "of": 4, "command": "train --steps 4"}]
    extended = run(7, "train --steps 7").runs
    assert extended == [{"steps": [0, 4], "of": 4, "command": "train --steps 4"},
                        {"steps": [4, 7], "of": 7, "command": "train --steps 7"}]
    assert run(7, "train --steps 7").runs == extended  # (a finished run asked again trains nothing more)
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=False)
    del state["runs"]  # a checkpoint from before runs were recorded: its steps are said to be unrecorded
    torch.save(state, tmp_path / "out" / "checkpoint.pt")
    assert run(9, "train --steps 9").runs[0] == {"steps": [0, 7], "of": None, "command": "not recorded"}


def test_a_finished_run_is_not_relabelled_with_fewer_steps(tmp_path):
    """The same command with a smaller --steps trained nothing, yet saved the longer run's weights under the
    shorter recipe."""
    _run(tmp_path / "run", 7)
    with pytest.raises(ValueError, match="at step 7, past --steps 4: give --steps 7 or more"):
        _run(tmp_path / "run", 4)


def test_a_cache_built_for_fewer_steps_says_how_to_train_on(tmp_path):
    """The chunk count defaults to --steps: resuming with more steps was refused as "other settings (chunks)"."""
    from mirrorsd.training import CACHE_META, check_cache

    meta = {"model": "m", "chunks": 200, "seq_len": 256}
    check_cache(tmp_path, meta)
    (tmp_path / "shard-0.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"other settings \(chunks\); --chunks 200 trains over it"):
        check_cache(tmp_path, meta | {"chunks": 400})
    with pytest.raises(ValueError, match=r"other settings \(seq_len\); give another --cache folder"):
        check_cache(tmp_path, meta | {"seq_len": 128})
    older = {k: v for k, v in meta.items() if k != "chunks"}  # a cache that recorded no chunk count
    (tmp_path / CACHE_META).write_text(json.dumps(older))
    with pytest.raises(ValueError, match=r"other settings \(chunks\); give another --cache folder"):
        check_cache(tmp_path, meta)


def test_ctrl_c_left_alone_where_it_is_ignored(tmp_path):
    """A trainer started with Ctrl-C ignored (a background job of a script) keeps it ignored: fit's own handler
    would have stopped it on a Ctrl-C meant for its parent."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _, done = _run(tmp_path / "x", 3, stop_at=2, interrupt=None)  # (the SIGINT arrives, and is ignored)
        assert done and [p["step"] for p in done["curve"]][-1] == 3
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_saves_nothing_half_done(tmp_path, monkeypatch):
    """The second Ctrl-C stops at once, anywhere in a step: landing after the optimizer's update it saved the step
    count before it, so the resumed run applied that update twice."""
    import mirrorsd.training as training

    whole, done = _run(tmp_path / "whole", 7, save_every=3)
    real, calls = training.optimize, {"n": 0}

    def interrupted(*args) -> None:
        real(*args)
        calls["n"] += 1
        if calls["n"] == 4:  # step 5's update is made; both Ctrl-Cs land before the step is counted
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)

    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as in a terminal: xdist's workers ignore it)
    try:
        monkeypatch.setattr(training, "optimize", interrupted)
        assert _run(tmp_path / "resumed", 7, save_every=3)[1] == {}  # (stopped)
    finally:
        signal.signal(signal.SIGINT, outer)
    monkeypatch.setattr(training, "optimize", real)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["step"] == 3  # the last whole one
    resumed, done_again = _run(tmp_path / "resumed", 7, save_every=3)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert done_again == done


def test_a_checkpoint_resumes_only_its_own_run(tmp_path):
    """Resuming with another learning rate ran the old one (the optimizer's state holds it); a finished run asked
    for with other settings trained nothing and was saved as if it had."""
    _run(tmp_path / "x", 7, stop_at=5)
    model = torch.nn.Linear(4, 1)
    trainable = Trainable(list(model.parameters()), model.state_dict, model.load_state_dict, "linear")
    with pytest.raises(ValueError, match=r"other settings .*'lr': \(0.05, 0.001\)"):
        fit(tmp_path / "x", trainable, [0, 1, 2], lambda i: (None, 0, {}), dict, steps=7, lr=1e-3, seed=3,
            eval_every=2, save_every=1, desc="test", progress=False)
    with pytest.raises(ValueError, match=r"other settings .*'loss': \(None, 'kl'\)"):
        fit(tmp_path / "x", trainable, [0, 1, 2], lambda i: (None, 0, {}), dict, steps=7, lr=0.05, seed=3,
            eval_every=2, save_every=1, desc="test", settings={"loss": "kl"}, progress=False)


def test_a_cache_of_text_that_changed_is_refused(tmp_path):
    """Text sources were keyed by their names alone: an edited file (or stdlib under another Python) reused a
    complete cache of the old text, or resumed a partial one from another chunking."""
    from mirrorsd.training import CACHE_META, open_cache

    text, cache = tmp_path / "notes.txt", tmp_path / "cache"
    text.write_text("one text\n")
    meta = {"model": "m", "chunks": 4, "seq_len": 8}
    open_cache(cache, meta, [str(text)], 4)
    (cache / "shard-00000.safetensors").write_bytes(b"")  # (states cached)
    open_cache(cache, meta, [str(text)], 4)  # the same text: resumed
    text.write_text("another text\n")
    with pytest.raises(ValueError, match=r"other settings \(data_digests\)"):
        open_cache(cache, meta, [str(text)], 4)
    text.write_text("one text\n")
    text.rename(tmp_path / "moved.txt")  # gone since: the cache made from it still serves
    open_cache(cache, meta, [str(text)], 4)
    (tmp_path / "moved.txt").rename(text)
    recorded = json.loads((cache / CACHE_META).read_text())
    del recorded["data_digests"]  # a cache from before the digests: taken as it was
    (cache / CACHE_META).write_text(json.dumps(recorded))
    open_cache(cache, meta, [str(text)], 4)


def test_a_complete_cache_resumes_while_its_distill_folder_grows(tmp_path):
    """Distill runs for days beside training: once its folder grew, a stopped run could not resume (the complete
    cache was refused, and the one the message asked for was rebuilt from the new shards, then its checkpoint
    refused). A complete cache reads none of the folder: it goes on as built. A partial one cannot."""
    from mirrorsd.training import HELD_OUT, open_cache, shard_paths

    folder, cache, meta = tmp_path / "distill", tmp_path / "cache", {"model": "m", "chunks": 4, "seq_len": 8}
    folder.mkdir()
    for i in range(2):
        (folder / f"shard-{i:05d}.npz").write_bytes(b"")
    sources = ["distill:" + str(folder)]
    _, complete, built = open_cache(cache, meta, sources, 4)
    assert not complete and built["data_shards"] == {sources[0]: 2}
    for path in [*shard_paths(cache, 4, 32), cache / HELD_OUT]:  # (states cached)
        path.write_bytes(b"")
    (folder / "shard-00002.npz").write_bytes(b"")  # distill went on
    with pytest.warns(UserWarning, match="built from 2 of the 3 shards"):
        _, complete, resumed = open_cache(cache, meta, sources, 4)
    assert complete and resumed == built  # (what the checkpoint recorded)
    (cache / HELD_OUT).unlink()  # a partial cache would be finished from other windows
    with pytest.raises(ValueError, match=r"other settings \(data_shards\)"):
        open_cache(cache, meta, sources, 4)


def test_a_run_resumes_only_on_the_data_it_started_on(tmp_path):
    """A distill folder that grew (or a text that changed) refuses the old cache; the user gives another, as told,
    and resumed: the new cache reshuffles the windows, so the resumed run's held-out windows were ones its first
    steps trained on (3 of 4 in a review's run). The checkpoint records the data's version with the cache's meta."""
    from mirrorsd.training import open_cache

    text, meta = tmp_path / "notes.txt", {"model": "m", "chunks": 4, "seq_len": 8}
    text.write_text("one text\n")
    _, _, first = open_cache(tmp_path / "cache", meta, [str(text)], 4)
    text.write_text("another text\n")
    _, _, second = open_cache(tmp_path / "another cache", meta, [str(text)], 4)
    assert first["data_digests"] != second["data_digests"] and first.items() >= meta.items()
    model = torch.nn.Linear(4, 1)
    trainable = Trainable(list(model.parameters()), model.state_dict, model.load_state_dict, "linear")
    run = lambda cache: fit(tmp_path / "out", trainable, [0, 1, 2], lambda i: (None, 0, {}), dict, steps=6,  # noqa: E731
                            lr=0.05, seed=3, eval_every=2, save_every=1, desc="test", settings={"cache": cache},
                            progress=False)
    run(first)
    with pytest.raises(ValueError, match=r"other settings .*'cache'"):
        run(second)
