"""``mirrorsd bench``: Spec-Bench questions through our methods and the peers, in one run, interleaved.

Protocol (Spec-Bench's, adapted): every question's turns go through the model's chat template, later turns
carrying the method's own earlier answers; a warm-up precedes timing; in each run every question visits every
method back to back with the order rotating per question, so machine drift hits all methods alike; each turn
is timed around the whole call (prefill included) with device synchronisation on GPUs. Every method's tokens
are checked against its AR reference (ours against ``ar``, HF's against ``hf-ar``, llama.cpp's against its
draft-less server); at a first divergence the reference model's logit gap between the two tokens is recorded,
telling a float near-tie from a bug.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..api import SELF_DRAFT, generate, load_model, planned, self_draft, shares_tokenizer
from ..decoding import REFERENCE, get_method, methods
from ..decoding.registry import split_specs
from ..decoding.suffix_index import isolated_shared_indexes
from ..errors import OptionError
from ..exit_heads import ExitTranslators
from ..files import write_text
from ..plans import cpu_name
from ..runtime import synchronize
from ..runtime.executors import split_threads
from ..runtime.load import busy_warning, others_cpu_share
from ..sampling import SAMPLING_EPS, SamplingParams
from ..specbench import GROUPS, Question, load_suite
from . import metrics, plan, probe
from .metrics import Answer, Turn, draft_counters
from .peers import HF_METHODS, LLAMA_METHODS, HFPeers, LlamaServer, find_llama_server, server_flags, truncated

NEAR_TIE = 1e-3  # logit units: a divergence with a smaller gap is float reordering, not a bug
PEER_REFERENCES = {"hf-assisted": "hf-ar", "hf-pld": "hf-ar", "hf-ar": "hf-ar", "llama-server": "llama-server-ar",
             "llama-server-ar": "llama-server-ar", "llama-server-ngram": "llama-server-ar"}
PEER_KINDS = ("hf-ar", "hf-assisted", "hf-pld", "llama-server", "llama-server-ar", "llama-server-ngram")
PEERS_NEEDING_DRAFT = {"hf-assisted", "llama-server"}


AUTO = "auto"  # --method auto: resolved to the plan's recommendation when the models are loaded


def ours(kind: str) -> bool:
    """A registered mirrorsd method (not a peer)."""
    return kind not in PEER_KINDS


def needs_draft(kind: str) -> bool:
    if kind == AUTO:
        return True  # the plan is keyed by the pair, and may pick a drafting method
    return kind in PEERS_NEEDING_DRAFT if not ours(kind) else get_method(kind).needs_draft


@dataclass
class MethodSpec:
    """One benchmarked configuration: ``label`` names it in the results, ``kind`` is the decoder."""

    label: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def reference(self) -> str:
        return PEER_REFERENCES.get(self.kind, REFERENCE)


def _value(text: str) -> Any:
    """A peer's option value (peers take few options and no registry): bool, int, float or the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


#: Where an answer ended, in a divergence: the likeliest of the target's end tokens there (:meth:`Bench._logit_gap`).
END = -2


def parse_methods(text: str) -> list[MethodSpec]:
    """``ar,sd,mirror:roots=budget:backend=threads:threads=2,1,fast=sd:gamma=4``: a kind with ``:key=value``
    options, optionally labelled ``LABEL=``. Our methods' options are parsed and checked by their registered options
    class, each key its name or its flag's (``depth`` or ``tree-depth``). References are added: ``ar`` always,
    ``hf-ar`` / ``llama-server-ar`` for their peers."""
    kinds = [*(m.name for m in methods()), *PEER_KINDS, AUTO]
    specs: list[MethodSpec] = []
    for item in split_specs(text):
        label = item
        if re.match(r"^[\w.\-]+=", item) and "=" in item.split(":")[0]:
            label, item = item.split("=", 1)
        kind, *pairs = item.split(":")
        if kind not in kinds:
            raise ValueError(f"unknown method {kind!r}; available: {', '.join(kinds)}")
        raw = {}
        for pair in pairs:
            if "=" not in pair:
                raise ValueError(f"method option {pair!r} in {item!r} must be key=value")
            key, value = pair.split("=", 1)
            raw[key] = value
        if kind == AUTO:
            if raw:
                raise ValueError("auto takes no options: it runs what `mirrorsd plan` recommended")
            options = {}
        elif ours(kind):
            options_type = get_method(kind).options
            raw = {options_type.named(k): v for k, v in raw.items()}
            try:
                parsed = options_type.parse(raw, kind)
            except OptionError as e:
                raise ValueError(f"{item}: {e}") from None
            options = {k: getattr(parsed, k) for k in raw}
        else:
            options = {k.replace("-", "_"): _value(v) for k, v in raw.items()}
        specs.append(MethodSpec(label, kind, options))
    for s in specs:  # a baseline's name on another decoder would silently become every ratio's denominator
        if s.label in (REFERENCE, "hf-ar", "llama-server-ar") and s.kind != s.label:
            raise ValueError(f"the label {s.label!r} names a baseline; give {s.kind} another label")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"method labels must be unique: {', '.join(labels)}")
    for ref in ("hf-ar", "llama-server-ar", REFERENCE):
        needed = ref == REFERENCE or any(s.reference == ref for s in specs)
        if needed and ref not in labels:
            specs.insert(0, MethodSpec(ref, ref))
    if specs[0].label != REFERENCE:  # the baseline first
        specs.sort(key=lambda s: s.label != REFERENCE)
    return specs


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "python": platform.python_version(),
                            "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import transformers

        info["transformers"] = transformers.__version__
        mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info



@dataclass
class BenchConfig:
    target: str
    draft: str | None
    methods: list[MethodSpec]
    suite: str = "specbench:1"
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # sampling filters (0 / 1: off), as generate takes them
    top_p: float = 1.0
    seed: int = 0
    runs: int = 3
    warmup: int = 1
    weights: str | None = None
    activations: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    llama_server: str | None = None
    probe: bool = True
    probe_exit_head: str | None = None  # a tuned-exit folder for the probe (None: the target's shipped one)
    probe_acceptance: str = "match"  # how the probe verifies when sampling: match (the methods' default) or rejection
    predict: bool = True
    threads_split: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.sampling(self.seed)  # bad sampling values fail before any model loads

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        d = dict(vars(self))
        d["methods"] = [vars(m) for m in self.methods]
        return d


class Bench:
    """Loads the models and peers once and runs every method on every question (see the module docstring)."""

    def __init__(self, config: BenchConfig, progress: bool = True) -> None:
        self.config, self.progress, self.notes = config, progress, []
        if config.max_new_tokens < 1 or config.runs < 1 or config.warmup < 0:
            raise ValueError("--max-new-tokens and --runs must be >= 1 and --warmup >= 0")
        self.questions = load_suite(config.suite)
        kinds = {m.kind for m in config.methods}
        drafting = sorted(k for k in kinds if needs_draft(k))
        if (drafting or config.probe) and not config.draft:
            raise ValueError(f"methods {', '.join(drafting) or 'and the probe'} need --draft")
        if config.probe_exit_head and not config.probe:
            raise ValueError("--probe-exit-head is read by the probe; drop --no-probe or the exit head")
        # read before the models load, so a wrong folder fails in seconds
        self.probe_exit = ExitTranslators.load(config.probe_exit_head) if config.probe_exit_head else None
        load = dict(device=config.device, dtype=config.dtype, weights=config.weights, activations=config.activations,
                    progress=progress)
        self.target = load_model(config.target, **load)
        if self.probe_exit is not None:
            for layer in self.probe_exit.layers:
                self.probe_exit.check(layer, self.target.config.hidden_size, self.target.config.n_layers)
        self.draft = None
        if drafting or config.probe:
            self.draft = (self_draft(self.target, config.draft) if config.draft.startswith(SELF_DRAFT)
                          else load_model(config.draft, **load))
        if self.draft is not None and not shares_tokenizer(self.target, self.draft):
            drafted = [k for k in drafting if k != AUTO]  # auto plans among the methods without one, as generate's
            cannot = [k for k in drafted if not ours(k) or not get_method(k).bridged]
            if cannot or (config.probe and drafted):
                takes = ", ".join(m.name for m in methods() if m.bridged)
                raise ValueError(f"draft {config.draft} has a tokenizer of its own, which only {takes} can draft with "
                                 f"(through text); not {', '.join(cannot or ['the probe (--no-probe)'])}")
            if not drafted:  # loaded for auto or the probe alone: nothing of this run drafts with it
                skipped = [*(["auto chose among the methods without a draft model"] if AUTO in kinds else []),
                           *(["the probe (which reads the draft in the target's token ids) did not run"]
                             if config.probe else [])]
                self.notes.append(f"draft {config.draft} has a tokenizer of its own: {' and '.join(skipped)}.")
                print(f"mirrorsd: note: {self.notes[-1]}", file=sys.stderr, flush=True)
                self.draft, config.probe = None, False
        config.methods = [self._resolve_auto(m) for m in config.methods]
        self.device = self.target.model.device
        self.hf = None
        if kinds & HF_METHODS:
            self.hf = HFPeers(self.target, self.draft if "hf-assisted" in kinds else None, self.device,
                              self.target.model.dtype)
        self.servers: dict[str, LlamaServer] = {}
        if kinds & LLAMA_METHODS:
            self._start_llama([m for m in config.methods if m.kind in LLAMA_METHODS])
        self.methods = [m for m in config.methods if m.kind not in LLAMA_METHODS or m.label in self.servers]
        self.answers: list[Answer] = []
        self.timeline: dict[str, Any] | None = None
        self.costs: plan.Costs | None = None  # the latency law's, once measured (kept by a stopped run's results)
        self.on_question: Callable[[], None] | None = None  # called as each question's answers are all in

    def _resolve_auto(self, spec: MethodSpec) -> MethodSpec:
        """``auto`` runs the plan's recommendation for this pair (planned now if there is none yet)."""
        if spec.kind != AUTO:
            return spec
        method, options, _ = planned(self.target, self.draft, {})
        chosen = ":".join([method, *(f"{k}={v}" for k, v in options.items())])
        self.notes.append(f"`{spec.label}` ran the plan's recommendation for this pair: `{chosen}`.")
        return MethodSpec(spec.label, method, options)

    def _start_llama(self, specs: list[MethodSpec]) -> None:
        """One llama-server per llama.cpp method, keyed by its label."""
        binary = find_llama_server(self.config.llama_server)
        gguf = lambda m: m.path / "model.gguf" if m is not None and m.path is not None else None  # noqa: E731
        t_gguf, d_gguf = gguf(self.target), gguf(self.draft)
        if binary is None:
            self.notes.append("llama-server skipped: no binary (put llama-server on PATH, set "
                              "MIRRORSD_LLAMA_SERVER or pass --llama-server PATH)")
            return
        drafting = any(spec.kind == "llama-server" for spec in specs)
        if t_gguf is None or not t_gguf.is_file() or drafting and (d_gguf is None or not d_gguf.is_file()):
            self.notes.append("llama-server skipped: the models are not zoo models with a GGUF file")
            return
        ctx = min(self.target.config.context_length, 8192)
        threads = torch.get_num_threads()
        for spec in specs:
            if spec.kind == "llama-server" and truncated(self.target, self.draft):
                self.notes.append(f"`{spec.label}` skipped: llama-server drafts with a model file, and the "
                                  f"{self.config.draft} draft is the target's first layers, not a file of its own")
                continue
            draft = d_gguf if spec.kind == "llama-server" else None
            flags = server_flags(spec.options) if spec.kind == "llama-server-ngram" else None
            try:
                self.servers[spec.label] = LlamaServer(binary, t_gguf, draft, threads, ctx, flags)
            except RuntimeError:
                self.close()  # no server outlives a failed start (a bad flag, a port, a crash)
                raise
            if flags:
                self.notes.append(f"`{spec.label}`: llama-server {' '.join(flags)}")
        self.notes.append(f"llama-server: {binary} on the same GGUF files, {threads} threads, its default "
                          "speculative settings unless noted, prompt cache off")

    def close(self) -> None:
        for server in self.servers.values():
            server.close()

    # -- one turn -----------------------------------------------------------------------------------------

    def _seed(self, question: Question) -> int:
        return self.config.seed * 1_000_003 + question.question_id

    def _generate(self, spec: MethodSpec, ids: list[int], seed: int, max_new: int) -> Turn:
        cfg = self.config
        if spec.kind in HF_METHODS:
            turn = self.hf.generate(spec.kind, ids, max_new, cfg.sampling(seed), spec.options)
            turn.text = self.target.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            return turn
        if spec.kind in LLAMA_METHODS:
            return self.servers[spec.label].complete(ids, max_new, cfg.sampling(seed), self.target.eos_token_ids)
        draft = self.draft if get_method(spec.kind).needs_draft else None
        synchronize(self.device)
        start = time.perf_counter()
        g = generate(self.target, ids, method=spec.kind, draft=draft, temperature=cfg.temperature, top_k=cfg.top_k,
                     top_p=cfg.top_p, seed=seed,
                     max_new_tokens=max_new, **spec.options)
        synchronize(self.device)
        wall = time.perf_counter() - start
        st = g.stats
        turn = Turn(new_tokens=st.new_tokens, wall_s=wall, token_ids=g.token_ids, text=g.text,
                    prefill_s=st.prefill_s, accept_lengths=[a + 1 for a in st.accepted] or [1] * st.new_tokens,
                    drafted=list(st.drafted) if st.accepted else [0] * st.new_tokens, steps=list(st.step_log))
        turn.counters = draft_counters(st)
        for extra in st.extra.values():
            turn.counters.update(extra.counters())
            overlapped = extra.timeline()  # the timeline shows the first overlapped run if any
            if overlapped is not None and st.spans and (
                    self.timeline is None or overlapped and not self.timeline["overlapped"]):
                origin = st.spans[0].start
                self.timeline = {"method": spec.label, "overlapped": overlapped, "spans": [
                    {"lane": s.lane, "name": s.name, "start": s.start - origin, "end": s.end - origin}
                    for s in st.spans]}
        return turn

    def _answer(self, spec: MethodSpec, question: Question, run: int, max_new: int) -> Answer:
        from ..api import encode_chat

        messages: list[dict[str, str]] = []
        turns = []
        # Every method answers every question in every run: an index of earlier outputs would hold this very
        # answer (another method's, or an earlier run's), so each answer starts from an empty one.
        with isolated_shared_indexes():
            for text in question.turns:
                messages.append({"role": "user", "content": text})
                ids = encode_chat(self.target, messages)
                limit = min(max_new, self.target.config.context_length - len(ids))
                if limit < 1:
                    raise ValueError(f"question {question.question_id}: the prompt ({len(ids)} tokens) fills the "
                                     "context")
                turn = self._generate(spec, ids, self._seed(question), limit)
                turn.prompt_ids = ids
                turns.append(turn)
                messages.append({"role": "assistant", "content": turn.text})
        return Answer(run, spec.label, question.question_id, question.category, question.group, turns)

    # -- the lossless check -------------------------------------------------------------------------------

    def _comparable(self, spec: MethodSpec) -> bool:
        if self.config.temperature < SAMPLING_EPS or spec.label == spec.reference:
            return True
        # Position-keyed sampling makes our match-acceptance methods equal ar token for token at any
        # temperature; speculative sampling and other libraries' RNGs only match in distribution.
        return ours(spec.kind) and spec.options.get("acceptance", "match") == "match"

    def _check(self, spec: MethodSpec, answer: Answer, reference: Answer) -> None:
        if not self._comparable(spec) or spec.label == spec.reference:  # (a baseline equal to itself proves nothing)
            return
        answer.equal_to_reference = True
        for i, (mine, ref) in enumerate(zip(answer.turns, reference.turns, strict=True)):
            pos = metrics.first_divergence(ref.token_ids, mine.token_ids)
            if pos is None:
                continue
            answer.equal_to_reference = False
            eos = END if self.target.eos_token_ids else -1
            expected = ref.token_ids[pos] if pos < len(ref.token_ids) else eos
            got = mine.token_ids[pos] if pos < len(mine.token_ids) else eos
            gap = self._logit_gap(spec, ref.prompt_ids + ref.token_ids[:pos], expected, got)
            verdict = None if gap is None else "float near-tie" if abs(gap) < NEAR_TIE else "mismatch"
            answer.divergence = {"turn": i, "position": pos, "reference_token": expected, "method_token": got,
                                 "logit_gap": gap, "verdict": verdict, "reference": spec.reference}
            return

    @torch.inference_mode()
    def _logit_gap(self, spec: MethodSpec, prefix: list[int], expected: int, got: int) -> float | None:
        """The reference's token's logit less the other's; :data:`END` is the likeliest of the model's end tokens
        there (an answer that ended; the smallest id was a token the model did not choose: SmolLM2's ends differ by
        12.7 logits at an answer's end)."""
        if -1 in (expected, got) or spec.kind in LLAMA_METHODS:  # (llama.cpp's logits are not exposed here)
            return None
        logits = None
        if spec.kind not in HF_METHODS or END in (expected, got):
            model = self.target.model
            cache = model.new_cache(capacity=len(prefix) + 1)
            logits = model(torch.tensor([prefix], device=model.device), cache=cache, last=1)[0, -1]
            end = max(self.target.eos_token_ids, key=lambda t: float(logits[t]))
            expected, got = (end if t == END else t for t in (expected, got))
        if spec.kind in HF_METHODS:
            return self.hf.logit_gap(prefix, expected, got)
        assert logits is not None
        return float(logits[expected] - logits[got])

    # -- the run ------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        cfg, methods = self.config, self.methods
        if (warning := busy_warning(others_cpu_share())) is not None:
            self.notes.append(warning)
            print(f"mirrorsd: warning: {warning}", file=sys.stderr, flush=True)
        costs = None
        if cfg.predict and self.target.model.device.type == "cpu":
            n = self.target.config.n_layers
            exits = sorted({layer for m in methods if m.kind != AUTO and ours(m.kind)
                            for layer in get_method(m.kind).options.parse(m.options, m.kind).priced_layers(n)})
            if self.progress:
                print("measuring forward costs for the latency law…", flush=True)
            costs = self.costs = plan.measure_costs(self.target.model, self.draft.model if self.draft else None,
                                                    exits, split=cfg.threads_split or split_threads())
        first = self.questions[0]
        for _ in range(cfg.warmup):
            for spec in tqdm(methods, desc="warm-up", disable=not self.progress, leave=False):
                self._answer(spec, Question(first.question_id, first.category, first.turns[:1]), -1,
                             min(16, cfg.max_new_tokens))
        self.timeline = None  # from a timed run, not the warm-up
        bar = tqdm(total=cfg.runs * len(self.questions) * len(methods), desc="bench", unit="answer",
                   disable=not self.progress, dynamic_ncols=True)
        for run in range(cfg.runs):
            for qi, question in enumerate(self.questions):
                rotation = (run + qi) % len(methods)  # (each run shifts every question's order)
                done: dict[str, Answer] = {}
                for spec in methods[rotation:] + methods[:rotation]:
                    done[spec.label] = self._answer(spec, question, run, cfg.max_new_tokens)
                    bar.set_postfix_str(f"run {run + 1} q{question.question_id} {spec.label} "
                                        f"{done[spec.label].speed:.1f} tok/s")
                    bar.update()
                for spec in methods:
                    if spec.reference in done:
                        self._check(spec, done[spec.label], done[spec.reference])
                self.answers.extend(done[spec.label] for spec in methods)
                if self.on_question is not None:
                    self.on_question()
        bar.close()
        probe_result = None
        if cfg.probe and self.draft is not None:
            from ..api import encode_chat
            from ..exit_heads import shipped_exit

            prompts = [(q.group, encode_chat(self.target, [{"role": "user", "content": q.turns[0]}]))
                       for q in self.questions]
            tuned = self.probe_exit  # the probe reads a tuned exit next to the lens: this one, else the shipped one
            if tuned is None and (shipped := shipped_exit(self.target.name or "")):
                tuned = ExitTranslators.load(shipped)
            probe_result = probe.run_probe(self.target, self.draft, prompts, cfg.max_new_tokens,
                                           progress=self.progress, tuned=tuned, temperature=cfg.temperature,
                                           top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed,
                                           acceptance=cfg.probe_acceptance).to_dict()
        return self.results(costs, probe_result)

    def results(self, costs: plan.Costs | None, probe_result: dict | None) -> dict[str, Any]:
        answers = self.answers
        present = {a.group for a in answers}
        groups = [*(g for g in GROUPS if g in present), *sorted(present - set(GROUPS))]
        summary = {}
        for spec in self.methods:
            s: dict[str, Any] = {
                "kind": spec.kind, "options": spec.options, "reference": spec.reference,
                "tokens_per_s": metrics.tokens_per_second(answers, spec.label),
                "speedup": metrics.speedups(answers, spec.label, REFERENCE),
                "mean_accepted_tokens": metrics.mean_accepted_tokens(answers, spec.label),
                "mat_by_group": {g: metrics.mean_accepted_tokens(answers, spec.label, g) for g in groups},
                "per_position_acceptance": metrics.per_position_acceptance(answers, spec.label),
                "lossless": metrics.lossless_summary(answers, spec.label),
                **metrics.method_extras(answers, spec.label),
            }
            if spec.reference != REFERENCE:
                s["speedup_vs_reference"] = metrics.speedups(answers, spec.label, spec.reference)
            if spec.kind in LLAMA_METHODS:
                c = metrics.pooled_counters(answers, spec.label)
                if c.get("draft_n"):
                    s["draft_acceptance_rate"] = c["draft_n_accepted"] / c["draft_n"]
            if spec.kind in HF_METHODS | LLAMA_METHODS:
                s["mean_accepted_tokens"] = None  # not exposed by these peers
                s["mat_by_group"] = {}
            if costs is not None:
                s["predicted_tokens_per_s"] = self._predicted(spec, costs)
            summary[spec.label] = s
        return {"config": self.config.to_dict(), "machine": machine(), "target_weights": self.target.weights,
                "target_format": self.target.format,
                "draft": self.config.draft if self.draft is not None else None,  # (the configured one may not load)
                "draft_format": self.draft.format if self.draft is not None else None,
                "notes": self.notes, "questions": len(self.questions), "summary": summary,
                "costs": costs.to_dict() if costs else None, "probe": probe_result, "timeline": self.timeline,
                "answers": [{**{k: v for k, v in vars(a).items() if k != "turns"},
                             "turns": [t.to_dict() for t in a.turns]} for a in answers]}

    def _predicted(self, spec: MethodSpec, costs: plan.Costs) -> float | None:
        """Mean per-question speed the latency law predicts from this method's own recorded steps; None where its
        cores are split otherwise than the one split the costs were measured at."""
        opts = get_method(spec.kind).options.parse(spec.options, spec.kind) if ours(spec.kind) else None
        threads = getattr(opts, "threads", None)
        if threads is None and getattr(opts, "backend", None) in ("threads", "processes"):
            threads = split_threads()  # (the backend's own default split, whatever --threads-split measured)
        if threads is not None and costs.split and list(threads) != list(costs.split["threads"]):
            note = (f"`{spec.label}` is not predicted: its threads {','.join(map(str, threads))} are not the split "
                    f"the costs were measured at ({','.join(map(str, costs.split['threads']))}; --threads-split)")
            if note not in self.notes:  # (results are written after every question)
                self.notes.append(note)
            return None
        speeds = []
        for a in (a for a in self.answers if a.method == spec.label and a.run == 0):
            times = [plan.turn_time(costs, spec.kind, t.steps, t.prefill_s, spec.options)
                     for t in a.turns]
            if any(t is None for t in times):
                return None
            speeds.append(a.new_tokens / sum(times))
        return sum(speeds) / len(speeds) if speeds else None


def write_answers(results: dict[str, Any], out: Path) -> list[Path]:
    """One Spec-Bench answer file per method: a line per question, ``choices[r]`` holding run r."""
    folder = out / "answers"
    folder.mkdir(parents=True, exist_ok=True)
    names = {label: re.sub(r"[^\w.\-]+", "_", label) + ".jsonl" for label in results["summary"]}
    for stale in folder.glob("*.jsonl"):  # (an earlier run's methods: not this run's answers)
        if stale.name not in names.values():
            stale.unlink()
    draft = results.get("draft", results["config"]["draft"])
    model_id = results["config"]["target"] + (f"+{draft}" if draft else "")
    paths = []
    for label in results["summary"]:
        rows: dict[int, dict[str, Any]] = {}
        for a in (a for a in results["answers"] if a["method"] == label):
            row = rows.setdefault(a["question_id"], {
                "question_id": a["question_id"], "category": a["category"], "answer_id": str(uuid.uuid4()),
                "model_id": f"{model_id}/{label}", "choices": [], "tstamp": time.time()})
            row["choices"].append({
                "index": a["run"], "turns": [t["text"] for t in a["turns"]],
                "decoding_steps": [len(t["accept_lengths"]) for t in a["turns"]],
                "new_tokens": [t["new_tokens"] for t in a["turns"]], "wall_time": [t["wall_s"] for t in a["turns"]],
                "accept_lengths": [n for t in a["turns"] for n in t["accept_lengths"]]})
        path = folder / names[label]
        write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows.values()))
        paths.append(path)
    return paths
