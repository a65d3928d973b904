"""The weight-format quality gate: does a quantized model answer chat prompts the way fp32 does?

Perplexity on plain source code missed what users hit (SmolLM2 q4 answered "L'Étoile, ..." to "What is the capital
of France?" while fp32 and HF said "Paris"), so the gate scores what users run: Spec-Bench questions through the
model's chat template (system prompt and special tokens included), each followed by the fp32 model's own greedy
answer. One teacher-forced forward per conversation and format then gives, against fp32:

* **next-token agreement**: the share of answer positions where the format's top-1 token is fp32's (fp32's
  greedy answer is its own top-1 at every position, so this is the share of answer tokens the format would
  emit itself);
* **identical answers**: conversations where the format agrees at every position, i.e. whose greedy answer is
  fp32's token for token (teacher forcing makes this exact, no second generation needed);
* **perplexity** of the fp32 answers under the format, as a change against fp32's own.

A format (weights × activation precision) passes when it reaches both :data:`MIN_AGREEMENT` and
:data:`MAX_PPL_INCREASE`; the zoo's per-model default (``ZooEntry.default_weights`` / ``default_activations``) is
the fastest one that passed on that model (:data:`SPEED_ORDER`, by one-token decoding cost).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

#: Gate thresholds: top-1 agreement with fp32 over answer tokens, and perplexity increase of fp32's answers.
MIN_AGREEMENT = 0.99
MAX_PPL_INCREASE = 0.02
#: Formats (weights/activations) from fastest to slowest one-token decoding here: int8x2 doubles the kernel's
#: activation rows, which one-token decoding (bandwidth-bound) barely notices. A model defaults to the first
#: format that passes the gate.
SPEED_ORDER = ("q4/int8", "q4/int8x2", "q8/int8", "q8/int8x2", "fp32")


@dataclass
class Conversation:
    """A chat-templated question followed by the reference model's greedy answer."""

    question_id: int
    group: str
    ids: list[int]
    answer_start: int  # index of the first answer token in ``ids``

    @property
    def answer_len(self) -> int:
        return len(self.ids) - self.answer_start


@dataclass
class Reference:
    """What the fp32 model says on the scored positions of one conversation."""

    argmax: torch.Tensor  # [answer_len]: equals the answer tokens
    nll: float  # summed NLL of the answer tokens


@dataclass
class FormatScore:
    model: str
    format: str  # "q4/int8": weights/activations
    positions: int
    agreement: float
    identical_answers: int
    conversations: int
    perplexity: float
    reference_perplexity: float
    first_divergence: list[int] = field(default_factory=list)  # per conversation, -1 = identical

    @property
    def ppl_increase(self) -> float:
        return self.perplexity / self.reference_perplexity - 1

    @property
    def passed(self) -> bool:
        return self.agreement >= MIN_AGREEMENT and self.ppl_increase <= MAX_PPL_INCREASE

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl_increase": self.ppl_increase, "passed": self.passed}


def chat_conversations(reference, questions, answer_tokens: int = 64, progress: bool = True) -> list[Conversation]:
    """Each question's first turn through ``reference``'s chat template plus its greedy answer (EOS kept, since
    ending the answer is a prediction too)."""
    from .api import encode_chat, generate
    from .decoding import REFERENCE

    conversations = []
    for q in tqdm(questions, desc=f"fp32 answers ({reference.name})", unit="q", disable=not progress):
        prompt = encode_chat(reference, [{"role": "user", "content": q.turns[0]}])
        g = generate(reference, prompt, method=REFERENCE, max_new_tokens=answer_tokens)
        ids = prompt + g.token_ids
        if g.finish_reason == "eos":  # the API drops the EOS id; models with several (Qwen) need the one it chose
            with torch.inference_mode():
                ids.append(int(reference.model(torch.tensor([ids], device=reference.model.device),
                                               last=1)[0, -1].argmax()))
        conversations.append(Conversation(q.question_id, q.group, ids, len(prompt)))
    return conversations


@torch.inference_mode()
def _answer_logits(model, conv: Conversation) -> torch.Tensor:
    """Log-probs predicting every answer token: rows ``answer_start - 1 .. len - 2``."""
    tokens = torch.tensor([conv.ids], device=model.device)
    logits = model(tokens, last=conv.answer_len + 1)[0, :-1].float()
    return F.log_softmax(logits, -1)


def reference_scores(model, conversations: list[Conversation], progress: bool = True) -> list[Reference]:
    out = []
    for conv in tqdm(conversations, desc="fp32 scores", unit="conv", disable=not progress):
        logp = _answer_logits(model, conv)
        answer = torch.tensor(conv.ids[conv.answer_start :], device=logp.device)
        out.append(Reference(logp.argmax(-1).cpu(), -float(logp.gather(1, answer[:, None]).sum())))
    return out


def score_format(model, conversations: list[Conversation], references: list[Reference], *, name: str,
                 fmt: str, progress: bool = True) -> FormatScore:
    """Agreement, identical answers and perplexity of ``model`` against the fp32 references."""
    agree = positions = identical = 0
    nll = ref_nll = 0.0
    divergence = []
    for conv, ref in tqdm(list(zip(conversations, references, strict=True)), desc=f"{fmt} scores",
                          unit="conv", disable=not progress):
        logp = _answer_logits(model, conv)
        answer = torch.tensor(conv.ids[conv.answer_start :], device=logp.device)
        same = (logp.argmax(-1).cpu() == ref.argmax)
        agree += int(same.sum())
        positions += same.numel()
        wrong = (~same).nonzero()
        divergence.append(int(wrong[0]) if wrong.numel() else -1)
        identical += not wrong.numel()
        nll += -float(logp.gather(1, answer[:, None]).sum())
        ref_nll += ref.nll
    return FormatScore(name, fmt, positions, agree / positions, identical, len(conversations),
                       math.exp(nll / positions), math.exp(ref_nll / positions), divergence)


def pick_default(scores: list[FormatScore]) -> str:
    """The fastest format that passed (fp32 is the reference and always passes)."""
    passed = {s.format for s in scores if s.passed} | {"fp32"}
    return next(w for w in SPEED_ORDER if w in passed)


def parse_formats(text: str) -> list[str]:
    """``"q4/int8,q8/int8x2"`` → checked format names."""
    from .loading import WEIGHT_FORMATS
    from .model import ACTIVATION_FORMATS

    formats = [f.strip() for f in text.split(",") if f.strip()]
    for f in formats:
        weights, _, acts = f.partition("/")
        if weights not in WEIGHT_FORMATS or weights == "fp32" or acts not in ACTIVATION_FORMATS:
            raise ValueError(f"format {f!r}: expected WEIGHTS/ACTIVATIONS with weights in q8, q4 and activations in "
                             f"{', '.join(ACTIVATION_FORMATS)} (fp32 is the reference)")
    if not formats:
        raise ValueError("no formats to score")
    return formats


def run(models: list[str], formats: list[str], questions, answer_tokens: int, out: Path,
        progress: bool = True) -> dict:
    """Score every model in every format; ``out/quality.json`` is rewritten after each score, and scores already
    there for the same questions and answer length are kept (a killed run resumes)."""
    from .api import load_model
    from .model import Transformer

    out.mkdir(parents=True, exist_ok=True)
    path = out / "quality.json"
    setup = {"questions": [q.question_id for q in questions], "answer_tokens": answer_tokens,
             "min_agreement": MIN_AGREEMENT, "max_ppl_increase": MAX_PPL_INCREASE}
    report = json.loads(path.read_text()) if path.is_file() else {}
    if report.get("setup") != setup:
        report = {"setup": setup, "models": {}}
    for name in models:
        done = report["models"].setdefault(name, {"scores": {}})["scores"]
        todo = [f for f in formats if f not in done]
        if todo:
            reference = load_model(name, weights="fp32", progress=progress)
            conversations = chat_conversations(reference, questions, answer_tokens, progress)
            references = reference_scores(reference.model, conversations, progress)
            folder = reference.path
            del reference
            for weights in dict.fromkeys(f.split("/")[0] for f in todo):
                model = Transformer.from_pretrained(folder, weights=weights)
                for fmt in (f for f in todo if f.startswith(weights + "/")):
                    model.use_activations(fmt.split("/")[1])
                    score = score_format(model, conversations, references, name=name, fmt=fmt,
                                         progress=progress)
                    done[fmt] = score.to_dict()
                    path.write_text(json.dumps(report, indent=2) + "\n")
        scores = [FormatScore(**{k: v for k, v in d.items() if k not in ("ppl_increase", "passed")})
                  for d in done.values()]
        report["models"][name]["default"] = pick_default(scores)
        path.write_text(json.dumps(report, indent=2) + "\n")
    (out / "quality.md").write_text(markdown(report) + "\n")
    return report


def markdown(report: dict) -> str:
    """The gate's table: one row per model and format."""
    setup = report["setup"]
    lines = [f"Chat quality gate: {len(setup['questions'])} Spec-Bench questions through each model's chat "
             f"template, fp32 greedy answers of up to {setup['answer_tokens']} tokens; pass = agreement >= "
             f"{setup['min_agreement']:.2f} and perplexity increase <= {100 * setup['max_ppl_increase']:.0f}%.",
             "", "| model | format | next-token agreement | identical answers | answer perplexity vs fp32 | "
             "passes | default |", "|---|---|---|---|---|---|---|"]
    for name, entry in report["models"].items():
        for fmt, d in entry["scores"].items():
            default = "**yes**" if entry.get("default") == fmt else ""
            lines.append(f"| {name} | {fmt} | {d['agreement']:.4f} ({d['positions']} tokens) | "
                         f"{d['identical_answers']}/{d['conversations']} | {100 * d['ppl_increase']:+.2f}% "
                         f"({d['perplexity']:.3f} vs {d['reference_perplexity']:.3f}) | "
                         f"{'yes' if d['passed'] else 'no'} | {default} |")
        if entry.get("default") == "fp32":
            lines.append(f"| {name} | fp32 | 1 | all | +0.00% | yes (reference) | **yes** |")
    return "\n".join(lines)
