"""The Spec-Bench questions vendored in the package (Apache-2.0, hemingkx/Spec-Bench; see the NOTICE beside them).

Task groups follow Spec-Bench: the eight MT-Bench categories pooled as ``mt_bench``, then translation,
summarization, qa, math_reasoning and rag (80 questions each).

``assist`` is a small suite of our own (``mirrorsd/data/assist``, 4 prompts each of ``editing``,
``refactoring`` and ``from_context``): what coding assistants and retrieval pipelines send -- a passage or a file and an
instruction to rewrite it or answer from it, where much of the answer repeats the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .sampling import is_integer

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def group(self) -> str:
        return "mt_bench" if self.category in MT_BENCH else self.category


def load_questions() -> list[Question]:
    text = resources.files("mirrorsd.data.spec_bench").joinpath("question.jsonl").read_text(encoding="utf-8")
    return [Question(q["question_id"], q["category"], tuple(q["turns"]))
            for q in map(json.loads, text.splitlines()) if q]


def subset(per_group: int) -> list[Question]:
    """``per_group`` questions of every group, spread evenly over the group and always the same ones."""
    if per_group < 1:
        raise ValueError(f"questions per group must be >= 1, got {per_group}")
    chosen = []
    questions = load_questions()
    for group in GROUPS:
        members = [q for q in questions if q.group == group]
        n = min(per_group, len(members))
        chosen.extend(members[(i * len(members)) // n] for i in range(n))
    return chosen


def load_assist() -> list[Question]:
    text = resources.files("mirrorsd.data.assist").joinpath("questions.jsonl").read_text(encoding="utf-8")
    return [Question(q["question_id"], q["category"], tuple(q["turns"]))
            for q in map(json.loads, text.splitlines()) if q]


def load_suite(spec: str) -> list[Question]:
    """``specbench`` (all 480), ``specbench:N`` (:func:`subset`), ``assist`` (our editing / refactoring / RAG
    prompts) or a JSONL file of Spec-Bench-style questions (``turns`` or ``prompt``; optional ``question_id``
    and ``category``, default the line number and ``custom``)."""
    if spec == "specbench":
        return load_questions()
    if spec == "assist":
        return load_assist()
    if spec.startswith("specbench:"):
        try:
            return subset(int(spec.removeprefix("specbench:")))
        except ValueError as e:
            raise ValueError(f"--suite specbench:N needs a positive number of questions per group ({e})") from None
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--suite {spec!r}: not 'specbench', 'specbench:N', 'assist' or an existing JSONL "
                                "file")
    questions, lines = [], {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"] if "turns" in row else [row["prompt"]]
            if not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError("turns must be non-empty strings")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f'{path}:{n}: expected a JSON object with "turns" (list) or "prompt" ({e})') from None
        qid = row.get("question_id", n)
        whole = is_integer(qid) or (isinstance(qid, float) and qid.is_integer()) or \
            (isinstance(qid, str) and qid.strip().lstrip("+-").isdigit())  # (12, 12.0 and "12" are taken)
        if not whole:  # (int("q2") failed as if "turns" were missing)
            raise ValueError(f'{path}:{n}: "question_id" must be an integer, got {json.dumps(qid)}')
        if int(qid) in lines:  # (answer files key rows by it: one of the two answers would be lost)
            raise ValueError(f"{path}:{n}: question_id {int(qid)} is taken by line {lines[int(qid)]} (a line without "
                             "one takes its line number)")
        lines[int(qid)] = n
        questions.append(Question(int(qid), str(row.get("category", "custom")), tuple(turns)))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions
