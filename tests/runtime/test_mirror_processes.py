"""Mirror-SD with ``--backend processes``: the draft rank in its own process, a gloo token channel (issue 20).

The target's tokens are computed in the calling process exactly as on the serial backend, so answers must
equal ``ar`` bit for bit on row-exact models, greedy and seeded; a draft process that dies or hangs is killed
and the request finishes with the target alone, still equal to ``ar``."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

from mirrorsd import Transformer, generate, stream
from mirrorsd.decoding import OptionError
from mirrorsd.decoding.mirror import remote as mirror_remote
from mirrorsd.runtime.processes import free_port
from tests.helpers import REPO, requires_smollm2, row_exact, tiny_hf

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def pair():
    target, draft = row_exact(tiny_hf(layers=4, seed=1)), row_exact(tiny_hf(layers=2, seed=2))
    yield target, draft
    mirror_remote.close_workers()


def _worker():
    (worker,) = mirror_remote._workers.values()
    return worker


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 7)])
def test_processes_equal_ar_and_serial(pair, temperature, seed):
    target, draft = pair
    want = generate(target, PROMPT, method="ar", max_new_tokens=40, temperature=temperature, seed=seed)
    serial = generate(target, PROMPT, method="mirror", draft=draft, max_new_tokens=40, temperature=temperature,
                      seed=seed)
    got = generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=40,
                   temperature=temperature, seed=seed)
    assert got.token_ids == want.token_ids == serial.token_ids
    stats = got.stats.extra["mirror"]
    assert stats.draft_failed is None and stats.backend == "processes"
    assert got.stats.accepted == serial.stats.accepted  # the same draft, rolled out in another process
    assert _worker().process.pid != os.getpid() and _worker().process.is_alive()
    summary = stats.to_dict()
    assert summary["channel_ms"]["early_exit"] >= 0 and summary["channel_ms"]["final"] >= 0
    lanes = {s.lane for s in got.stats.spans}
    assert lanes == {"target", "draft"}  # the draft lane's spans were timed in the draft's process


def test_the_draft_rank_serves_request_after_request(pair):
    target, draft = pair
    generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=8)
    first = _worker().process.pid
    generate(target, PROMPT[:20], method="mirror", draft=draft, backend="processes", max_new_tokens=8)
    assert _worker().process.pid == first


def test_two_requests_at_once_each_draft_with_a_rank_of_their_own(pair):
    """Two live streams on one draft (API threads, or an app reading two clients' streams in turns) shared its one
    rank: each one's messages went into the other's session, the rank was killed, and both went on with the target
    alone (63 and 57 draft forwards where each makes ~270 alone). The second now gets a rank for itself."""
    target, draft = pair
    prompts, kw = [PROMPT, PROMPT[5:30]], dict(method="mirror", draft=draft, backend="processes", max_new_tokens=24)
    alone = [generate(target, p, **kw) for p in prompts]
    shared = _worker()
    streams = [stream(target, p, **kw) for p in prompts]
    turns = [s.deltas() for s in streams]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ("the draft failed ... continuing with the target alone" is the defect)
        while turns:
            for t in list(turns):
                if next(t, None) is None:
                    turns.remove(t)
    for s, a in zip(streams, alone, strict=True):
        assert s.result.token_ids == a.token_ids
        assert s.result.stats.extra["mirror"].draft_failed is None
        assert s.result.stats.draft_forwards == a.stats.draft_forwards > 0
    assert _worker() is shared and shared.alive() and not mirror_remote._held  # (the private rank was closed)


def _decode_while(pair, act):
    """Generate with the processes backend, calling ``act(worker)`` after the first step's tokens. The draft rank
    is started and warmed first with the default timeout: a rank still starting on a loaded host can take longer
    than the short timeout below, and the request would give it up before ``act`` (a flaky test)."""
    target, draft = pair
    generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=4)
    want = generate(target, PROMPT, method="ar", max_new_tokens=40, temperature=0.0).token_ids
    s = stream(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=40,
               temperature=0.0, channel_timeout=3.0)
    deltas = s.deltas()
    next(deltas)
    worker = _worker()
    act(worker)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in deltas:
            pass
    assert s.result.token_ids == want  # nothing lost, nothing repeated
    assert any("continuing with the target alone" in str(w.message) for w in caught)
    worker.process.join(5)
    assert not worker.process.is_alive()  # no orphan left behind
    return s.result.stats.extra["mirror"]


def test_a_killed_draft_rank_leaves_the_target_going_alone(pair):
    stats = _decode_while(pair, lambda worker: worker.process.kill())
    why = stats.draft_failed
    assert "ChannelError" in why and ("exited with code -9" in why or "Timed out" not in why), why  # not a hang


def test_a_hung_draft_rank_times_out(pair):
    stats = _decode_while(pair, lambda worker: os.kill(worker.process.pid, signal.SIGSTOP))
    why = stats.draft_failed
    assert "ChannelError" in why and "Timed out" in why and "exited" not in why, why


def test_a_new_draft_rank_replaces_a_failed_one(pair):
    """A rank that died between requests is replaced before the next one starts. (The kill is waited for: right
    after SIGKILL the process may not be reaped yet and still look alive; the request then meets the dying rank
    mid-step and goes on with the target alone, which the tests above cover.)"""
    target, draft = pair
    generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=4)
    dead = _worker().process
    dead.kill()
    dead.join(5)
    got = generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=16)
    assert got.stats.extra["mirror"].draft_failed is None
    assert _worker().process.pid != dead.pid and _worker().process.is_alive()


def test_rejection_sampling_is_refused_with_a_reason(pair):
    target, draft = pair
    with pytest.raises(OptionError, match="token ids only"):
        generate(target, PROMPT, method="mirror", draft=draft, backend="processes", acceptance="rejection",
                 temperature=0.8)


def test_draft_candidates_cross_the_channel(pair):
    """candidates=draft: the draft rank sends its likeliest tokens with every window, so the target's process
    picks the same roots and hits the same branches as on the serial backend (paper roots: no timing involved)."""
    target, draft = pair
    want = generate(target, PROMPT, method="ar", max_new_tokens=40)
    runs = {}
    for backend, candidates in (("serial", "exit"), ("serial", "draft"), ("processes", "draft")):
        got = generate(target, PROMPT, method="mirror", draft=draft, backend=backend, candidates=candidates,
                       roots="paper", kappa=2, max_new_tokens=40)
        assert got.token_ids == want.token_ids
        runs[backend, candidates] = [step.hit for step in got.stats.extra["mirror"].steps]
    assert runs["serial", "draft"] != runs["serial", "exit"]  # else this prompt could not tell them apart
    assert runs["processes", "draft"] == runs["serial", "draft"]
    assert _worker().process.is_alive()


def test_an_error_the_draft_rank_meets_starting_a_request_reaches_the_caller_at_once(pair, tmp_path):
    """START gets no reply: the draft rank sent its error while the caller was sending, both blocked in gloo for
    the channel's timeout (60 s by default), and the rank's own message was lost."""
    target, draft = pair
    generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=4)  # (warm)
    (tmp_path / "stream_config.json").write_text("{}")  # found here; the draft rank cannot build it
    want = generate(target, PROMPT, method="ar", max_new_tokens=12).token_ids
    start = time.monotonic()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=12,
                       draft_streams=str(tmp_path), channel_timeout=30.0)
    assert time.monotonic() - start < 15 and got.token_ids == want
    why = got.stats.extra["mirror"].draft_failed
    assert "the other process failed: ValueError: stream adapter was trained for" in why, why


@requires_smollm2
def test_what_only_the_draft_rank_reads_is_checked_before_the_request():
    """As the serial backend refuses them: the draft rank met them only after the request had started."""
    import mirrorsd

    target = mirrorsd.load_model("smollm2-135m", progress=False)
    draft = mirrorsd.api.self_draft(target, "self:10")
    with pytest.raises(ValueError, match="larger than"):
        generate(target, "Hi", method="mirror", draft=draft, backend="processes", draft_vocab=10**9)
    with pytest.raises(FileNotFoundError, match="no stream adapter"):
        generate(target, "Hi", method="mirror", draft=draft, backend="processes", draft_streams="/no/such/dir")
    assert not any(ref() is draft.model for ref in mirror_remote._served.values())  # (no rank was started)


def test_a_collected_draft_takes_its_draft_rank_with_it(pair):
    """Draft ranks were kept by the draft's id and never swept: each new draft object left a process (and its
    shared weights, ~350 MB for SmolLM2) behind."""
    target, _ = pair
    draft = row_exact(tiny_hf(layers=2, seed=5))
    generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=4)
    (key,) = [k for k, ref in mirror_remote._served.items() if ref() is draft]
    process = mirror_remote._workers[key].process
    del draft
    gc.collect()
    process.join(5)
    assert not process.is_alive() and key not in mirror_remote._workers


def test_close_workers_stops_every_draft_rank(pair):
    target, draft = pair
    generate(target, PROMPT, method="mirror", draft=draft, backend="processes", max_new_tokens=4)
    process = _worker().process
    mirror_remote.close_workers()
    assert not process.is_alive() and not mirror_remote._workers
    assert torch.get_num_threads() >= 1


def _cli_json(argv: list[str], launcher: list[str] | None = None) -> dict:
    proc = subprocess.run([*(launcher or [sys.executable, "-m"]), "mirrorsd.cli", "generate", *argv, "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("{")]  # rank 1 prints nothing
    return json.loads(line)


@requires_smollm2
def test_torchrun_world_of_target_and_draft_ranks():
    """`torchrun --nproc-per-node 2 -m mirrorsd.cli generate --backend processes`: rank 0 decodes, rank 1 serves
    the draft over the channel group, and the answer is ar's (the launcher's ranks could be on two machines)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--target", "smollm2-135m", "--prompt", "Name three colours.", "--max-new-tokens", "24"]
    want = _cli_json([*args, "--method", "ar"])
    got = _cli_json([*args, "--method", "mirror", "--draft", "self:0.5", "--backend", "processes"],
                    launcher=[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(port), "-m"])
    assert got["token_ids"] == want["token_ids"]
    mirror = got["stats"]["extra"]["mirror"] if "extra" in got["stats"] else got["stats"]["mirror"]
    assert mirror["backend"] == "processes" and mirror["draft_failed"] is None
    assert mirror["channel_ms"]["final"] >= 0


def test_tensor_parallel_target_with_a_draft_rank(tmp_path):
    """``--target-tp 2`` + a draft rank (3 gloo ranks): Mirror-SD over the channel equals the sharded target's own
    ``ar``, greedy and seeded; both target ranks decode the same tokens; each holds half the heads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr",
                           "127.0.0.1", "--master-port", str(port), "-m", "tests.runtime.tp_world", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0.pop("trace_lanes") == ["draft rank 2", "target rank 0", "target rank 1"]  # one lane per rank
    assert rank1.pop("trace_lanes") == []
    assert rank0 == rank1  # the same loop on both target ranks
    for label in ("greedy", "seeded"):
        assert rank0[f"mirror_{label}"] == rank0[f"ar_{label}"] and len(rank0[f"ar_{label}"]) == 24
        assert rank0[f"mirror_{label}_failed"] is None and rank0[f"mirror_{label}_steps"] < 24  # drafts accepted
    assert rank0["ar_greedy"] == rank0["unsharded_ar"]  # a small model: the sharded sums did not flip a token
    assert "suffix_match=0" in rank0["refused"]
    assert "use backend='serial'" in rank0["self_draft_refused"]
    assert "shards dense weights" in rank0["quantized_refused"] and rank0["refused_left_whole"]
    assert "sharded already" in rank0["sharded_refused"]
    assert rank0["local_heads"] == [2, 1]


@pytest.mark.parametrize("syncs", ["spd", "layer"])
def test_a_draft_sharded_over_two_ranks(tmp_path, syncs):
    """``--draft-tp 2``: the draft's ranks serve one target rank. ``spd`` (two segments of tracks) makes two
    all-reduces per draft forward and computes something else than the whole draft; ``layer`` (Megatron) makes two
    per layer and computes the draft's own logits. Either way Mirror-SD's output is ``ar``'s, and the all-reduces
    show in the stats and the trace."""
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr",
                           "127.0.0.1", "--master-port", str(port), "-m", "tests.runtime.spd_world", str(tmp_path),
                           syncs], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    per_forward = 2 if syncs == "spd" else 2 * 4  # the draft has 4 layers
    assert rank1["all_reduces"] == per_forward  # one forward
    if syncs == "spd":
        assert rank1["gap"] > 1e-3  # dropped syncs: another function
        assert rank1["tracks_gap"] < 1e-4  # ... the one run_tracks computes in one process (train-draft's form)
    else:
        assert rank1["gap"] < 1e-4  # the same function, summed in another order
    for label in ("greedy", "seeded"):
        assert rank0[f"mirror_{label}"] == rank0[f"ar_{label}"] and len(rank0[f"ar_{label}"]) == 24
        assert rank0[f"mirror_{label}_failed"] is None
        assert rank0[f"mirror_{label}_per_forward"] == pytest.approx(per_forward, rel=0.05)  # prompt forwards aside
        assert rank0[f"mirror_{label}_traced"] == rank0[f"mirror_{label}_counted"] > 0
        assert rank0[f"mirror_{label}_ms"] > 0  # either form times its own all-reduces


def test_target_tp_outside_torchrun_is_a_clear_error(capsys):
    from mirrorsd.cli import main

    rc = main(["generate", "--method", "ar", "--target-tp", "2", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "--target-tp 2 runs under torchrun: torchrun --nproc-per-node 2" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--method", "mirror", "--backend", "processes", "--draft-tp", "2"], "--draft-tp 2 runs under torchrun: torchrun "
     "--nproc-per-node 3"),
    (["--method", "sd", "--draft-tp", "2"], "it takes --method mirror --backend processes"),
    (["--method", "mirror", "--backend", "threads", "--draft-tp", "2"], "it takes --method mirror --backend processes"),
    (["--method", "mirror", "--backend", "processes", "--draft-tp", "2", "--draft-streams"],
     "its stream adapter cannot follow"),
    (["--method", "mirror", "--backend", "processes", "--draft-tp", "0"], "--draft-tp must be >= 1"),
])
def test_draft_tp_errors_say_what_to_run(capsys, argv, message):
    from mirrorsd.cli import main

    rc = main(["generate", *argv, "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err


def test_a_connection_closed_at_the_call_is_a_channel_error_too():
    """gloo raises a closed connection from ``send``/``recv`` themselves when the peer is already gone (the killed
    draft test met it under load), not only from the wait."""
    from mirrorsd.runtime.processes import ChannelError, wait_for

    def closed():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:28576.")

    with pytest.raises(ChannelError, match="Connection closed by peer"):
        wait_for(closed, 1.0)


def test_a_failed_torchrun_draft_rank_is_abandoned_with_its_own_error():
    """A ``torchrun`` world's draft rank is the launcher's process (no exit code to read here): abandoning it keeps
    the channel's error as the reason, where reading a process's exit code once raised an AttributeError instead."""
    from mirrorsd.runtime.processes import ChannelError, LaunchedPeer

    side = mirror_remote.RemoteDraft.__new__(mirror_remote.RemoteDraft)
    side.worker = LaunchedPeer(channel=None)  # type: ignore[arg-type]
    error = ChannelError("the channel to the other process failed (timed out)")
    assert side.abandon(error) is error
    assert side.worker.broken == f"ChannelError: {error}"


UNGUARDED_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from mirrorsd import generate
from tests.helpers import tiny_hf
from tests.helpers import row_exact

target, draft = row_exact(tiny_hf(layers=2, seed=1)), row_exact(tiny_hf(layers=1, seed=2))
out = generate(target, list(range(3, 20)), method="mirror", draft=draft, backend="processes", max_new_tokens=8)
print("ANSWER", out.token_ids == generate(target, list(range(3, 20)), method="ar", max_new_tokens=8).token_ids)
print("FAILED", out.stats.extra["mirror"].draft_failed)
"""


def test_a_script_without_a_main_guard_is_told_at_once(tmp_path):
    """A script that starts the backend at import time: the spawned draft process imports it again and stops
    there (its generation never runs twice), and the caller, told at once rather than after the setup timeout,
    answers with the target alone and names the fix."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT.format(root=str(REPO)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ANSWER") == 1 and "ANSWER True" in done.stdout
    failed = done.stdout.split("FAILED", 1)[1]
    assert "exited (code 1) before it connected" in failed and 'if __name__ == "__main__":' in failed
    assert "a draft process was asked for another draft process" in done.stderr


def test_the_all_reduce_law_fits_and_predicts():
    """T = α log₂G + β·M: the fit recovers α and β from sizes at one G, and the script times real all-reduces."""
    from mirrorsd.bench.allreduce import fit

    alpha, beta = fit(2, [896, 8 * 896, 64 * 896], [1e-4 + 2e-9 * m for m in (896, 8 * 896, 64 * 896)])
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(2e-9)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), "-m", "mirrorsd.bench.allreduce",
                           "--repeats", "5", "--rows", "1,4"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["ranks"] == 2 and set(out["measured_ms"]) == {"1", "4"} and min(out["measured_ms"].values()) > 0
    step = out["predicted"]["1"]
    assert step["layer_step_ms"] == pytest.approx(24 * step["spd_step_ms"], rel=1e-3)


def test_a_draft_worker_serves_only_the_draft_it_was_spawned_for(monkeypatch):
    """Workers are kept by the draft's id: a model that gets a collected draft's id must get a worker of its own,
    not one drafting with the old weights."""
    import weakref

    class FakeWorker:  # (no process: this is about which worker a draft gets)
        def __init__(self, entry, args, threads=None) -> None:
            self.draft, self.closed = args[0], False

        def alive(self) -> bool:
            return not self.closed

        def close(self) -> None:
            self.closed = True

        def abandon(self, why: str) -> None:
            self.closed = True

    monkeypatch.setattr(mirror_remote, "Worker", FakeWorker)
    monkeypatch.setattr(mirror_remote, "_workers", {})
    monkeypatch.setattr(mirror_remote, "_served", {})
    old, new = tiny_hf(layers=1, seed=3), tiny_hf(layers=1, seed=4)
    worker = mirror_remote.draft_worker(old, None)
    assert mirror_remote.draft_worker(old, None) is worker  # kept for later requests
    key = (id(new), None)  # as if `new` had been given the id of a collected `old`
    mirror_remote._workers[key], mirror_remote._served[key] = worker, weakref.ref(old)
    fresh = mirror_remote.draft_worker(new, None)
    assert fresh is not worker and fresh.draft is new and worker.closed


def test_a_gpu_model_refused_for_sharding_names_the_flag_that_asked(monkeypatch):
    """`--draft-tp` on a GPU draft was refused with a message about `--target-tp`, which the user never gave."""
    from torch import nn

    from mirrorsd.runtime import tensor_parallel

    monkeypatch.setattr(tensor_parallel.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(tensor_parallel.dist, "get_rank", lambda group=None: 0)
    for shard, flag in ((tensor_parallel.shard_target, "--target-tp"), (tensor_parallel.shard_draft, "--draft-tp")):
        model = Transformer.from_hf(tiny_hf(layers=4, seed=1), linear="dense")
        model.embed_tokens.weight = nn.Parameter(torch.empty_like(model.embed_tokens.weight, device="meta"))
        with pytest.raises(ValueError, match=f"^{flag} shards a model on CPUs"):
            shard(model, None)


def test_an_api_call_inside_a_callers_torchrun_world_spawns_its_own_draft_process(monkeypatch):
    """Data-parallel API calls under the user's torchrun took that world's last rank as their draft (stalling for
    the channel's timeout and leaving the default process group set up): only a world mirrorsd's CLI joined is
    served by a draft rank; elsewhere each rank spawns its own draft process."""
    class FakeWorker:  # (no process: this is about which kind of draft rank a call gets)
        def __init__(self, entry, args, threads=None) -> None:
            self.draft = args[0]

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            pass

        def abandon(self, why: str) -> None:
            pass

    def launched(tp):
        raise AssertionError("took the launcher's world")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(mirror_remote, "Worker", FakeWorker)
    monkeypatch.setattr(mirror_remote, "_launched_channel", launched)
    monkeypatch.setattr(mirror_remote, "_workers", {})
    monkeypatch.setattr(mirror_remote, "_served", {})
    draft = tiny_hf(layers=1, seed=3)
    assert isinstance(mirror_remote.draft_worker(draft, None), FakeWorker)
    assert not torch.distributed.is_initialized()
