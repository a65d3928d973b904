"""``mirrorsd distill``: the prompt set (size, kinds, no Spec-Bench text) and the resumable, batched data engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

import mirrorsd
from mirrorsd.distill.engine import (
    INDEX_FILE,
    PROMPTS_FILE,
    Record,
    Settings,
    Shards,
    read_prompts,
    records,
    run,
    sampled,
)
from mirrorsd.distill.prompts import (
    KINDS,
    SELF_INSTRUCT,
    Prompt,
    build,
    chat_items,
    digest,
    extend,
    leaks,
    more_chat_items,
)
from mirrorsd.specbench import load_suite
from tests.helpers import requires_smollm2


@pytest.fixture(scope="module")
def prompts() -> list[Prompt]:
    return build()


def test_at_least_20000_distinct_prompts_of_every_kind_built_alike(prompts):
    assert len(prompts) >= 25_000 and len({p.turns for p in prompts}) == len(prompts)
    per_kind = Counter(p.kind for p in prompts)
    assert set(per_kind) == set(KINDS) and min(per_kind.values()) >= 300, per_kind
    assert [p.id for p in prompts] == list(range(len(prompts)))
    assert {len(p.turns) for p in prompts if p.kind in ("multi-turn", "summarize-own", "to-english")} == {2}
    first_chat = next(i for i, p in enumerate(prompts) if p.kind in KINDS[8:])  # version 2's kinds follow 1's
    second, third = chat_items(), more_chat_items()
    assert {p.kind for p in prompts[first_chat:]} == set(KINDS[8:])
    assert first_chat == len(prompts) - len(second) - len(third)
    # Version 3's wave follows version 2's, so a folder frozen at version 2 that gains it has the same ids.
    assert prompts == extend(extend(prompts[:first_chat], second), third)
    assert [(p.kind, p.turns) for p in prompts[-len(third):]] == third and not set(second) & set(third)
    assert Counter(p.kind for p in prompts[:500]).keys() == set(KINDS[:8])  # any prefix covers every kind
    for start in (first_chat, len(prompts) - len(third)):
        assert Counter(p.kind for p in prompts[start:start + 500]).keys() == set(KINDS[8:])
    assert digest(build()) == digest(prompts)  # deterministic: a run resumes by id


@requires_smollm2
def test_no_13_token_window_of_a_prompt_occurs_in_spec_bench(prompts):
    """Spec-Bench stays a test set (checked with the tokenizer CI has; Qwen's agrees, see docs/distill.md)."""
    tokenizer = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False).tokenizer
    questions = [turn for q in load_suite("specbench") for turn in q.turns]
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert leaks(prompts, tokenize, questions) == []
    planted = Prompt(len(prompts), "qa", (f"Please answer this: {questions[7]}",))
    assert leaks([*prompts[:50], planted], tokenize, questions) == [planted.id]  # the check does catch one


MINI = [Prompt(0, "qa", ("Name a colour.",)), Prompt(1, "multi-turn", ("Say hi.", "Say it shorter.")),
        Prompt(2, SELF_INSTRUCT, ("Write one question about tea. Reply with the question only.",)),
        Prompt(3, "math", ("What is 2 + 3?",)), Prompt(4, "code", ("Write a Python one-liner that sums a list.",)),
        Prompt(5, "translation", ("Translate into French: The cat sleeps.",))]


def test_a_folder_frozen_before_the_chat_kinds_gains_them_with_its_ids_and_shards_kept(tmp_path):
    settings = Settings("smollm2-135m")
    shards = Shards(tmp_path, settings, MINI)
    shards.write([Record(1, 0, "multi-turn", False, [1, 2], [3])], 1.0)
    new = chat_items()[:5]
    assert shards.add_prompts(new) == 5 and shards.add_prompts(new) == 0  # appended once
    again = Shards(tmp_path, settings)  # a new process reads the grown frozen set
    assert again.prompts == extend(MINI, new) and [p.id for p in again.prompts[6:]] == [6, 7, 8, 9, 10]
    assert again.prompts[:6] == MINI and again.done == {1}
    kinds = {kind for kind, _ in new}
    assert [p.id for p in again.pending(kinds)] == [p.id for p in again.prompts[6:] if p.kind in kinds]
    assert [p.id for p in again.pending()] == [0, *range(2, 11)]


@requires_smollm2
def test_the_engine_answers_in_batches_resumes_and_keeps_each_answer_as_alone(tmp_path):
    target = mirrorsd.load_model("smollm2-135m", weights="q8", progress=False)
    settings = Settings("smollm2-135m", max_new_tokens=12, sampled_share=0.5)
    shards = Shards(tmp_path, settings, MINI)
    first = run(target, shards, batch=3, shard_items=2, items=4, progress=False)
    assert first["answered"] == 4 and len(shards.done) == 4
    assert first["prefix_cache_hit_tokens"] > 0  # the chat template's shared start, prefilled once
    again = Shards(tmp_path, settings)  # a new process: the frozen prompts and the shards on disk
    assert [p.id for p in again.pending()] == sorted(set(range(6)) - again.done) and len(again.pending()) == 2
    run(target, again, batch=3, shard_items=2, progress=False)
    assert again.done == set(range(6)) and read_prompts(tmp_path / PROMPTS_FILE) == MINI
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["done_items"] == 6 and index["done_per_kind"]["multi-turn"] == 1 and index["shards"] >= 3
    assert index["answer_tokens"] > 0 and index["settings"]["max_new_tokens"] == 12

    rows = list(records(tmp_path))
    assert len(rows) == 6 + 1 + 1  # a second turn, and the self-instruct question asked anew
    shard = np.load(sorted(tmp_path.glob("shard-*.npz"))[0])
    assert shard["tokens"].dtype == np.uint32
    # Every answer is the model's own, alone: greedy or seeded sampling, through the batcher or not.
    by_item = {}
    for data in map(np.load, sorted(tmp_path.glob("shard-*.npz"))):
        for s, a, e, item, turn in zip(data["start"], data["answer"], data["end"], data["item"], data["turn"],
                                       strict=True):
            by_item[(int(item), int(turn))] = (data["tokens"][s:a].tolist(), data["tokens"][a:e].tolist())
    assert any(sampled(i, 0.5) for i in range(6)) and not all(sampled(i, 0.5) for i in range(6))
    for (item, turn), (prompt_ids, answer_ids) in by_item.items():
        temperature = 0.7 if sampled(item, 0.5) else 0.0
        alone = mirrorsd.generate(target, prompt_ids, max_new_tokens=12, temperature=temperature, seed=item)
        assert alone.token_ids == answer_ids, (item, turn)

    with pytest.raises(ValueError, match="other settings"):
        Shards(tmp_path, Settings("smollm2-135m", max_new_tokens=99))

    # The trainers read the folder as token ids (train-streams / train-exit --data distill:FOLDER).
    from mirrorsd.training import corpus_texts, data_versions, make_chunks

    source = f"distill:{tmp_path}"
    docs = corpus_texts([source])
    # The multi-turn item's second record holds its first whole, ids for ids: the first is read only there, its
    # answer still marked as the model's.
    extended = [k for k in range(len(rows) - 1) if len(rows[k + 1][0]) > len(rows[k][0])
                and rows[k + 1][0][:len(rows[k][0])].tolist() == rows[k][0].tolist()]
    assert len(extended) == 1
    k = extended[0]
    kept = [ids.tolist() for j, (ids, _, _) in enumerate(rows) if j != k]
    assert [t for d in docs for t in d] == [t for ids in kept for t in ids]
    marks = [m for d in docs for m in d.answer]
    start = sum(len(ids) for ids in kept[:k])  # where the second turn's record begins
    (first, first_answer, _), (second, second_answer, _) = rows[k], rows[k + 1]
    want = [False] * first_answer + [True] * (len(first) - first_answer)
    want += [False] * (second_answer - len(first)) + [True] * (len(second) - second_answer)
    assert marks[start:start + len(second)] == want
    chunks = make_chunks(None, docs, 8, 4, 0)
    assert len(chunks) == 4 and all(c.ids.shape == (8,) for c in chunks)
    assert data_versions([source, "stdlib"]) == {source: index["shards"]}


@requires_smollm2
def test_sigterm_stops_a_run_and_keeps_the_answers_in_flight(tmp_path):
    """A run in the background (where the shell leaves SIGINT ignored) is stopped by SIGTERM as by Ctrl-C: the items
    in flight finish and are written, though no shard was due yet."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mirrorsd.cli", "distill", "--model", "smollm2-135m", "--out",
                             str(out), "--max-new-tokens", "6", "--batch", "2", "--shard-items", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    progress = b""
    while b"| 1/" not in progress and b"| 2/" not in progress:  # tqdm: an item is done
        byte = proc.stderr.read(1)
        assert byte, progress.decode(errors="replace")
        progress += byte
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode(errors="replace")[-2000:]
    summary = json.loads(stdout.decode().splitlines()[0])
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["done_items"] == summary["done_items"] >= 2  # the answered item and the one in flight


def test_one_run_writes_to_a_folder_at_a_time(tmp_path):
    """Two runs on one folder would number their next shard alike and replace each other's."""
    settings = Settings("smollm2-135m", max_new_tokens=4)
    first, second = Shards(tmp_path, settings, MINI), Shards(tmp_path, settings)
    with first.writing(), pytest.raises(ValueError, match="another mirrorsd distill is writing to"), \
            second.writing():
        pass
    with second.writing():  # free again once the first run ends
        pass


def test_ctrl_c_inside_a_flush_writes_no_record_twice(tmp_path, monkeypatch):
    """A Ctrl-C landing in a shard's flush after the shard is in place (here: in its index) must not write those
    records again as the run's last shard."""
    from mirrorsd.distill import engine

    def answered(target, item, settings, store):
        return [Record(item.id, 0, item.kind, False, [1, 2, 3], [4, 5])]

    monkeypatch.setattr(engine, "answer", answered)
    monkeypatch.setattr(engine, "Batcher", lambda speculation: type("B", (), {"member": lambda self: _no_op()})())
    settings = Settings("smollm2-135m", max_new_tokens=4)
    shards = Shards(tmp_path, settings, MINI)
    index, calls = Shards.write_index, []

    def interrupted(self):
        calls.append(1)
        index(self)
        if len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(Shards, "write_index", interrupted)
    run(None, shards, batch=1, shard_items=2, progress=False, prefix_cache_bytes=0)
    items = [int(i) for data in map(np.load, sorted(tmp_path.glob("shard-*.npz"))) for i in data["item"]]
    assert len(items) == len(set(items)) and set(items) <= set(range(6))


def _no_op():
    import contextlib

    return contextlib.nullcontext()


def test_a_record_another_holds_whole_trains_once(tmp_path):
    """A multi-turn item opens with a code item's prompt word for word; answered greedily, both record the same ids.
    Its second turn holds that record whole, so the code item's copy goes too; an exact repeat is kept once."""
    from mirrorsd.training import distill_documents

    settings = Settings("smollm2-135m", max_new_tokens=4)
    shards = Shards(tmp_path, settings, MINI)
    first_turn = ([1, 2, 3], [4, 5])
    shards.write([Record(0, 0, "code", False, *first_turn),  # the code item
                  Record(9, 0, "qa", False, [7, 7], [8]),
                  Record(9, 0, "qa", False, [7, 7], [8])], 1.0)  # (the same record twice)
    shards.write([Record(5, 0, "multi-turn", False, *first_turn),  # its first turn: the code item's ids
                  Record(5, 1, "multi-turn", False, [1, 2, 3, 4, 5, 6], [7])], 1.0)
    (doc,) = distill_documents(tmp_path)
    assert list(doc) == [7, 7, 8, 1, 2, 3, 4, 5, 6, 7]
    assert doc.answer == [False, False, True, False, False, False, True, True, False, True]


def test_the_index_is_on_disk_before_its_name_replaces_the_old_one(tmp_path, monkeypatch):
    """A shard or index renamed into place before its bytes reach the disk is an empty file after a power cut."""
    from mirrorsd import files
    from mirrorsd.distill import engine

    synced = []
    real = files.os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    engine.write_atomic(tmp_path / "index.json", b"{}\n")
    assert synced and (tmp_path / "index.json").read_bytes() == b"{}\n" and not list(tmp_path.glob("*.tmp"))
    shards, before = Shards(tmp_path / "folder", Settings("smollm2-135m", max_new_tokens=4), MINI), len(synced)
    shards.write([Record(0, 0, "code", False, [1, 2], [3])], 1.0)
    assert len(synced) >= before + 2 and not list((tmp_path / "folder").glob("incomplete-*"))  # the shard, the index


def test_a_ctrl_c_writes_the_answers_made_before_waiting_for_those_in_flight(tmp_path, monkeypatch):
    """SIGTERM's grace is short (docker stop: 10 s, then SIGKILL): the answers already made were written only after
    the items in flight finished, so a kill in between lost them all."""
    from mirrorsd.distill import engine

    seen: list[bool] = []

    def answered(target, item, settings, store):
        if item.id == 2:  # in flight: finishes only once it sees the others on disk (or gives up)
            deadline = time.monotonic() + 5
            while not list(tmp_path.glob("shard-*.npz")) and time.monotonic() < deadline:
                time.sleep(0.02)
            seen.append(bool(list(tmp_path.glob("shard-*.npz"))))
        return [Record(item.id, 0, item.kind, False, [1, 2, 3], [4, 5])]

    class Bar:  # tqdm's stand-in: Ctrl-C once two items are answered
        def __init__(self, *args, **kwargs):
            self.n = 0

        def update(self, n):
            self.n += n
            if self.n == 2:
                raise KeyboardInterrupt

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(engine, "answer", answered)
    monkeypatch.setattr(engine, "tqdm", Bar)
    monkeypatch.setattr(engine, "Batcher", lambda speculation: type("B", (), {"member": lambda self: _no_op()})())
    shards = Shards(tmp_path, Settings("smollm2-135m", max_new_tokens=4), MINI)
    run(None, shards, batch=3, shard_items=100, items=3, progress=False, prefix_cache_bytes=0)
    assert seen == [True]
    first = np.load(sorted(tmp_path.glob("shard-*.npz"))[0])
    assert sorted(first["item"].tolist()) == [0, 1] and Shards(tmp_path, shards.settings).done == {0, 1, 2}


def test_a_folder_without_its_index_still_refuses_other_settings(tmp_path):
    """The settings lived only in the index: a shard written before the first index (a crash between the two) or a
    deleted index let another model's answers join the folder."""
    shards = Shards(tmp_path, Settings("smollm2-135m", max_new_tokens=4), MINI)
    shards.write([Record(0, 0, "code", False, [1, 2], [3])], 1.0)
    (tmp_path / INDEX_FILE).unlink()
    with pytest.raises(ValueError, match="shard-00000.npz was made with other settings"):
        Shards(tmp_path, Settings("qwen2.5-coder-1.5b", max_new_tokens=4))
    assert Shards(tmp_path, shards.settings).done == {0}


def test_a_shard_on_disk_but_not_yet_listed_is_not_overwritten(tmp_path):
    """A Ctrl-C between a shard's rename and its listing numbered the next shard alike, which replaced it."""
    shards = Shards(tmp_path, Settings("smollm2-135m", max_new_tokens=4), MINI)
    shards.write([Record(0, 0, "code", False, [1, 2], [3])], 1.0)
    shards.shards.pop()  # (as if the Ctrl-C came right after the rename)
    shards.write([Record(1, 0, "code", False, [1, 2], [3])], 1.0)
    assert Shards(tmp_path, shards.settings).done == {0, 1}
