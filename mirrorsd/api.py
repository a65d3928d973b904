"""The HF-like Python API: :func:`load_model`, :func:`generate` and :func:`stream`.

This layer owns everything a method should not care about: tokenisation and chat templates, input
validation, EOS / stop strings / ``max_new_tokens``, incremental detokenisation and timing.
"""

from __future__ import annotations

import json
import math
import secrets
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cache import cache_dir
from .collector import paused_collector
from .decoding import REFERENCE, DecodeRequest, GenerationStats, ModelShape, default_method, get_method, methods
from .decoding.bridge import TokenBridge
from .decoding.engine import run
from .decoding.suffix_index import isolated_shared_indexes
from .errors import OptionError
from .execution import release_thread_team
from .kept import Kept
from .model import ACTIVATION_FORMATS, Transformer
from .prefix_cache import PrefixCache
from .sampling import SamplingParams, is_integer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A model with its tokenizer and generation defaults (the tokenizer may be None for bare models)."""

    model: Transformer
    tokenizer: Any = None
    name: str = ""
    path: Path | None = None
    eos_token_ids: frozenset[int] = frozenset()
    weights: str = "fp32"
    activations: str = "int8"

    @property
    def config(self):
        return self.model.config

    @property
    def format(self) -> str:
        """What was loaded, for messages: ``fp32``, ``fp32 weights in bfloat16``, or ``q4 weights, int8x2
        activations``."""
        if self.weights != "fp32":
            return f"{self.weights} weights, {self.activations} activations"
        dtype = getattr(self.model, "dtype", torch.float32)
        return "fp32" if dtype == torch.float32 else f"fp32 weights in {str(dtype).removeprefix('torch.')}"


def default_format(name_or_path: str | Path, path: Path, device: str | torch.device,
                   dtype: torch.dtype, asked: str | None = None) -> tuple[str, str]:
    """The (weights, activations) a model loads with when none are asked for.

    Zoo models: the fastest format that passed the chat quality gate on that model (``ZooEntry.default_weights``
    / ``default_activations``, measured by ``mirrorsd bench quality``; docs/benchmarks.md). Other folders
    holding a ``model.gguf``: its q4 codes with two-plane int8 activations, the setting that passed the gate on
    every zoo model. Everything else, and any GPU or non-fp32 load: fp32.
    """
    from .zoo import ZOO

    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "fp32", "int8"
    entry = ZOO.get(str(name_or_path))
    if entry is not None:
        return entry.default_weights, entry.default_activations
    folder = Path(path)
    if not (folder / "model.gguf").is_file():
        return "fp32", "int8"
    if asked is None and folder.resolve().parent != cache_dir().resolve() and any(folder.glob("*.safetensors")):
        warnings.warn(f"{folder} holds a model.gguf beside its safetensors weights: by default its q4 codes load, "
                      "which do not follow a change to the safetensors (a fine-tune saved into a copy of a zoo "
                      "folder); give weights='fp32' or 'q8' (--weights) to load the safetensors", stacklevel=3)
    return "q4", "int8x2"


def usable_device(device: str | torch.device) -> torch.device:
    """``device`` as torch names it, checked before anything loads: a typo or a GPU this machine lacks is one clear
    error, not a traceback from deep inside the load."""
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {str(device)!r} (cpu, cuda, cuda:1, ...): {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this machine has no usable CUDA GPU (torch {torch.__version__})")
    return device


def load_model(name_or_path: str | Path, *, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = torch.float32, weights: str | None = None, activations: str | None = None,
               linear: str = "auto", progress: bool = True) -> LoadedModel:
    """Load a zoo model by name (prepared on first use), a local HF checkpoint folder, or a tuned draft's folder
    (``mirrorsd train-draft``: its base model with the deltas merged, :mod:`.tuned_drafts`).

    ``weights``: ``fp32``, ``q8`` or ``q4`` (see :data:`mirrorsd.loading.WEIGHT_FORMATS`); ``activations``: ``int8``
    or ``int8x2`` for quantized weights (:data:`mirrorsd.model.ACTIVATION_FORMATS`). None picks
    :func:`default_format` (the model's default activations also apply to weights asked for explicitly).
    ``linear="dense"`` keeps PyTorch's stock GEMMs instead of our kernels (a baseline for benchmarks).
    """
    from transformers import AutoTokenizer

    from . import tuned_drafts, zoo

    device = usable_device(device)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():  # (torch.int8 loaded, then failed at the first token)
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    if activations is not None and activations not in ACTIVATION_FORMATS:
        raise ValueError(f"activations must be one of {ACTIVATION_FORMATS}, got {activations!r}")
    base, deltas = name_or_path, None
    if (tuned := tuned_drafts.resolve(name_or_path)) is not None:
        base, deltas = tuned_drafts.load_config(tuned).base, tuned_drafts.deltas(tuned)
    path = zoo.resolve(base, progress=progress)
    default_weights, default_acts = default_format(base, path, device, dtype, asked=weights)
    weights = weights or default_weights
    activations = "int8" if weights == "fp32" else activations or default_acts  # fp32 has no quantized layer
    with paused_collector():
        model = Transformer.from_pretrained(path, device=device, dtype=dtype, weights=weights, linear=linear,
                                            activations=activations, deltas=deltas).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    eos = end_ids(path, tokenizer, converted=base in zoo.ZOO)
    return LoadedModel(model, tokenizer, str(name_or_path), path, frozenset(eos), weights, activations)


#: Tokens llama.cpp ends generation on by their text in any GGUF vocabulary (``llama-vocab.cpp``'s EOG list): a
#: GGUF names one EOS, so Qwen's converted generation config lost ``<|endoftext|>``, which its published one lists.
GGUF_END_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                            "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"})


def end_ids(path: Path, tokenizer: Any, converted: bool = False) -> set[int]:
    """The ids generation ends on, as HF's ``generate`` takes them: the tokenizer's EOS and the generation config's,
    or without a ``generation_config.json`` the model config's (HF builds the generation config from it then).
    ``converted``: a zoo model converted from a GGUF, which also ends on the special tokens llama.cpp ends on
    (:data:`GGUF_END_TEXTS`)."""
    from transformers import GenerationConfig

    eos: set[int] = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    if (path / "generation_config.json").exists():
        ids = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
    else:
        ids = json.loads((path / "config.json").read_text()).get("eos_token_id")
    eos.update([ids] if isinstance(ids, int) else ids or [])
    if converted:
        eos.update(i for i, token in tokenizer.added_tokens_decoder.items()
                   if token.special and token.content in GGUF_END_TEXTS)
    return eos


SELF_DRAFT = "self:"


def self_draft_depth(spec: str) -> int | float:
    """``self:N``'s layer count or ``self:F``'s fraction, checked before any model loads."""
    text = spec.removeprefix(SELF_DRAFT)
    try:
        return int(text)
    except ValueError:
        pass
    try:
        fraction = float(text)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction < 1:  # (inf and nan passed, to fail after loading as an OverflowError)
        raise ValueError(f"draft {spec}: give self:N (the target's first N layers) or self:F (a fraction of them "
                         "between 0 and 1, e.g. self:0.5)")
    return fraction


def self_draft(target: LoadedModel, spec: str) -> LoadedModel:
    """``self:N`` / ``self:F``: the target's first N layers (or that fraction of them) as a draft, sharing its
    weights (the early layers are the cheapest draft that needs nothing loaded)."""
    depth = self_draft_depth(spec)
    n_layers = target.config.n_layers
    layers = round(depth * n_layers) if isinstance(depth, float) else depth
    if not 0 < layers < n_layers:
        raise ValueError(f"draft {spec}: the self-draft needs 1..{n_layers - 1} of the target's layers")
    # One prefix model per target and depth: what is built for a draft (its process, its subset heads, its
    # CUDA caches) is keyed by the draft model, and a new one per request built them all again (a draft process
    # spawned per request: ~9 s each on SmolLM2)
    prefix = _SELF_DRAFTS.get(target.model, layers, lambda: target.model.prefix_model(layers))
    return LoadedModel(prefix, target.tokenizer, f"{target.name}[:{layers}]", target.path, target.eos_token_ids,
                       target.weights, target.activations)


# target -> {layers: its prefix model}: the 2 most recent depths (a sweep over depths kept a draft process each)
_SELF_DRAFTS = Kept(2)


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # new tokens only
    stats: GenerationStats
    finish_reason: str  # "eos", "stop" or "length"
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


def _as_loaded(m: LoadedModel | Transformer, role: str = "target") -> LoadedModel:
    if isinstance(m, LoadedModel):
        return m
    if not isinstance(m, Transformer):  # a name given where a model is wanted failed as an AttributeError
        hint = f": load it first, {role}=mirrorsd.load_model({m!r})" if isinstance(m, str | Path) else ""
        raise TypeError(f"{role} must be a model from mirrorsd.load_model (or a Transformer), got "
                        f"{type(m).__name__}{hint}")
    return LoadedModel(m)


Prompt = str | Sequence[int] | Sequence[dict[str, str]]  # text, token ids or chat messages


def encode_chat(target: LoadedModel, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of a conversation (``[{"role": "user", "content": ...}, ...]``) through the model's chat template,
    ending with the assistant's turn; a tokenizer without a template gets the turns' contents joined."""
    tok = target.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer; pass token ids instead of text")
    for n, m in enumerate(messages):  # (a jinja2 UndefinedError from inside the template, or a KeyError)
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {n} needs a text 'role' and 'content' ({{'role': 'user', 'content': "
                             f"...}}), got {str(m)[:60]}")
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok("\n\n".join(m["content"] for m in messages))["input_ids"]


def encode_prompt(target: LoadedModel, prompt: Prompt, *, raw: bool = False) -> list[int]:
    """Token ids for a prompt: ids pass through; text goes through the chat template unless ``raw``; chat
    messages (``[{"role": ..., "content": ...}]``, as HF pipelines take them) through the template."""
    if isinstance(prompt, torch.Tensor):  # HF's input_ids: [T] or one row [1, T], of integers
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(f"a tensor prompt is one sequence of token ids, [T] or [1, T] of integers; got "
                             f"{list(prompt.shape)} of {prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, str):
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            ids = encode_chat(target, items)
        elif all(is_integer(t) for t in items):
            ids = [int(t) for t in items]
        else:  # ("1", 1.9 and True were taken as ids)
            kind = next(type(t).__name__ for t in items if not is_integer(t))
            raise ValueError("a prompt is text, token ids or chat messages ([{'role': 'user', 'content': ...}]); "
                             f"got a sequence holding {kind}")
    elif raw:
        if target.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids instead of text")
        ids = target.tokenizer(prompt)["input_ids"]
    else:
        ids = encode_chat(target, [{"role": "user", "content": prompt}])
    if not ids:
        raise ValueError("the prompt is empty")
    vocab = target.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
    return ids


#: Target tokenizer → draft tokenizer → whether they share a vocabulary (comparing two 152k-entry vocabularies costs
#: ~0.2 s, which every request paid, and a server with a draft of another tokenizer asks twice per request).
_SHARED_VOCABS: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, bool]] = weakref.WeakKeyDictionary()


def shares_tokenizer(target: LoadedModel, draft: LoadedModel) -> bool:
    a, b = target.tokenizer, draft.tokenizer
    if a is None or b is None or a is b:
        return True
    known = _SHARED_VOCABS.setdefault(a, weakref.WeakKeyDictionary())
    if b not in known:
        known[b] = a.get_vocab() == b.get_vocab()
    return known[b]


def draft_bridge(method: str, target: LoadedModel, draft: LoadedModel) -> TokenBridge | None:
    """None when the draft shares the target's token ids; a :class:`~mirrorsd.decoding.bridge.TokenBridge` when it
    does not and ``method`` drafts through text (``sd``); otherwise the mismatch, as a ValueError."""
    if shares_tokenizer(target, draft):
        return None
    mismatch = (f"tokenizer mismatch: draft {draft.name or '(draft)'} does not share the vocabulary of target "
                f"{target.name or '(target)'}")
    if not get_method(method).bridged:
        takes = ", ".join(m.name for m in methods() if m.bridged)
        raise ValueError(f"{mismatch}; method {method!r} needs identical token ids (with another tokenizer, use "
                         f"{takes}: it drafts through text)")
    try:
        return TokenBridge(target.tokenizer, draft.tokenizer)
    except ValueError as e:
        raise ValueError(f"{mismatch}, and it cannot draft through text: {e}") from None


@dataclass(frozen=True)
class ZooFiles:
    """The files shipped with the request's zoo models (:class:`~mirrorsd.decoding.registry.ShippedFiles`), which
    method options default to: the zoo's adapters and tuned exits live at this layer, not in ``decoding``."""

    target: LoadedModel
    draft: LoadedModel | None

    def streams(self, role: str) -> Path:
        """The Speculative Streaming adapter shipped for a zoo model (``streams=`` overrides it)."""
        from .decoding.streams.adapters import shipped_adapter

        model = self.target if role == "target" else self.draft
        folder = shipped_adapter(model.name or "") if model is not None else None
        if folder is None:
            name = model.name if model is not None and model.name else "this model"
            raise ValueError(f"no shipped stream adapter for {name}; pass streams=FOLDER (or --streams) with an "
                             "adapter from `mirrorsd train-streams`")
        return folder

    def tuned_exit(self, option: str) -> str:
        """The tuned early exit shipped for a zoo target (``option=FOLDER`` overrides it)."""
        from .exit_heads import shipped_exit

        folder = shipped_exit(self.target.name or "")
        if folder is None:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"no shipped tuned exit for {self.target.name or 'this model'}; pass {option}=FOLDER "
                             f"(or {flag} FOLDER) with one from `mirrorsd train-exit`")
        return str(folder)

    def exit_for_layer(self, layer: int) -> str | None:
        from .exit_heads import shipped_exit

        folder = shipped_exit(self.target.name or "", layer)
        return None if folder is None else str(folder)


def planned(target: LoadedModel, draft: LoadedModel | Transformer | None,
             options: dict[str, Any]) -> tuple[str, dict[str, Any], LoadedModel | Transformer | None]:
    """``method="auto"``: the configuration `mirrorsd plan` recommended for this pair on this machine (planned
    briefly now on first use); options given explicitly win over the plan's."""
    from .plans import plan_for

    draft = _as_loaded(draft, "draft") if draft is not None else None
    unnamed = [role for role, m in (("target", target), ("draft", draft)) if m is not None and not m.name]
    if unnamed or target.tokenizer is None:  # plans are saved per named pair and measured on text prompts
        raise ValueError(f"method='auto' follows the plan saved for a named target and draft and plans on text, so "
                         f"it needs models from mirrorsd.load_model (this {unnamed[0] if unnamed else 'target'} has "
                         f"{'no name' if unnamed else 'no tokenizer'}): give a method instead")
    if not windows_exact(target.model):  # only ar can be exact there: nothing to plan or to price
        print(f"mirrorsd: method auto: {str(target.model.dtype).removeprefix('torch.')} on a CPU runs only ar "
              "exactly (exact_windows), so auto chooses it", file=sys.stderr, flush=True)
        for name in options:
            raise OptionError(name, f"is not an option of method {REFERENCE!r}, which method='auto' chose; name a "
                              "method to use it")
        return REFERENCE, {}, None
    if draft is not None and not shares_tokenizer(target, draft):
        print(f"mirrorsd: method auto: draft {draft.name} has a tokenizer of its own (the plan probes acceptance in "
              f"the target's token ids), so auto chooses among the methods without a draft model", file=sys.stderr,
              flush=True)
        draft = None
    recommended = plan_for(target, draft)["recommended"]
    method = recommended["method"]
    takes = {o.name for o in get_method(method).options.fields()}
    for name in options:
        if name not in takes:  # ("gamma is not an option of method 'ar'", of a method the user never named)
            raise OptionError(name, f"is not an option of method {method!r}, which method='auto' chose from this "
                              "machine's plan for the pair; name a method to use it")
    return method, {**recommended["options"], **options}, draft if get_method(method).needs_draft else None


@dataclass
class StreamDelta:
    """What one decoding step added to the output, for servers and UIs that show how tokens were produced.

    ``text`` is the new text (possibly empty: bytes of a character, or a possible stop string, are held back);
    ``segments`` split it by the token that produced each character, as ``(text, source)`` with source
    ``"draft"`` (a draft token the target accepted: a draft model's, a suffix match's or a stream's) or
    ``"target"`` (the target's own token: the correction or bonus every step ends with). ``token_ids`` /
    ``sources``: the step's committed tokens after EOS, stop strings and ``max_new_tokens`` cut them.
    """

    text: str
    segments: list[tuple[str, str]]
    token_ids: list[int]
    sources: list[str]


class GenerationStream:
    """Iterates over text deltas as tokens are committed (:meth:`deltas` gives per-step detail);
    ``.result`` holds the :class:`Generation` after."""

    def __init__(self, target: LoadedModel, prompt_ids: list[int], steps: Iterator[list[int]],
                 request: DecodeRequest, stop: str | Sequence[str], ignore_eos: bool = False) -> None:
        self.target, self.prompt_ids, self.request = target, prompt_ids, request
        self.ignore_eos = ignore_eos  # decode past EOS (kept as output) up to max_new_tokens: fixed-length loads
        self.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]  # "" would match at once
        self._steps: Iterator[list[int]] | None = steps
        self._iteration: Iterator[StreamDelta] | None = None  # the one iteration over the steps, once asked for
        self.token_ids: list[int] = []
        self.result: Generation | None = None
        self._text = ""
        self._emitted = 0
        self._ends: list[tuple[int, str]] = []  # (text length after token i, its source), for segments
        self._closed = False  # close() was called: the iteration ends at its next step, whichever thread asked
        self._reader: int | None = None  # the thread iterating, once it started

    def _decode(self, ids: list[int]) -> str:
        tok = self.target.tokenizer
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""

    def __iter__(self) -> Iterator[str]:
        iteration = self._run(segments=False)
        self._iteration = self._iteration or iteration
        return (d.text for d in iteration if d.text)

    def close(self) -> None:
        """Stop generating (a client went away), also mid-iteration: the engine's steps end now, not when the
        iterator is collected; ``.result`` stays None unless the stream had finished. From another thread than the
        one reading, it ends the stream at the reader's next read (after the step in flight): the engine's steps
        are closed in the reader's thread, which closing them here would race."""
        self._closed = True
        if self._reader is not None and self._reader != threading.get_ident():
            return  # (another thread reads it: closing the generator here would race its next read)
        if self._iteration is not None:
            self._iteration.close()
        if self._steps is not None:  # (never iterated)
            self._steps.close()
            self._steps = None

    def deltas(self) -> Iterator[StreamDelta]:
        """One :class:`StreamDelta` per decoding step (and a last one with any held-back text)."""
        iteration = self._run(segments=True)
        self._iteration = self._iteration or iteration  # (a second iteration raises at once: nothing to close)
        return iteration

    def _run(self, segments: bool) -> Iterator[StreamDelta]:
        # segments cost a decode per drafted token, so plain text iteration (CLI, bench) skips them
        if self._steps is None:
            raise RuntimeError("a GenerationStream can be iterated only once")
        self._reader = threading.get_ident()
        req, stats = self.request, self.request.stats
        finish = "length"
        start = time.perf_counter()
        steps, self._steps = self._steps, None
        try:
            for chunk in steps:
                if self._closed:  # (closed from another thread during this step: its tokens are not output)
                    return
                done = False
                kept: list[int] = []
                sources: list[str] = []
                for i, token in enumerate(chunk):
                    self.token_ids.append(token)
                    if token in self.target.eos_token_ids and not self.ignore_eos:
                        self.token_ids.pop()  # like HF, the EOS id is a stop signal, not output
                        finish, done = "eos", True
                        break
                    kept.append(token)
                    sources.append("target" if i == len(chunk) - 1 else "draft")
                    if self.stop and self._hit_stop():
                        finish, done = "stop", True
                        break
                    if len(self.token_ids) >= req.max_new_tokens:
                        done = True
                        break
                if done and len(kept) < len(chunk) and stats.step_log:  # EOS or a stop string cut this step:
                    stats.step_log[-1]["output"] = len(kept)  # what it accepted past the cut is no output
                if finish != "stop":
                    self._text = self._decode(self.token_ids)
                if segments:
                    self._mark_ends(kept, sources)
                yield self._delta(final=done, token_ids=kept, sources=sources)
                if self._closed:  # (closed from another thread while the reader held this delta)
                    return
                if done:
                    break
        finally:
            steps.close()
            stats.wall_s = time.perf_counter() - start
            stats.new_tokens = len(self.token_ids)
            stats.prompt_tokens = len(self.prompt_ids)
        tail = self._delta(final=True, token_ids=[], sources=[])
        if tail.text:
            yield tail
        self.result = Generation(self._text, self.token_ids, stats, finish, self.prompt_ids)

    def _mark_ends(self, kept: list[int], sources: list[str]) -> None:
        """Where each new token's text ends, by decoding the output up to it (only when several tokens came)."""
        first = len(self.token_ids) - len(kept)
        for i, source in enumerate(sources):
            end = len(self._text) if i == len(kept) - 1 else len(self._decode(self.token_ids[: first + i + 1]))
            self._ends.append((min(end, len(self._text)), source))

    def _delta(self, final: bool, token_ids: list[int], sources: list[str]) -> StreamDelta:
        begin = self._emitted
        text = self._pending_text(final)
        stop, position = begin + len(text), begin
        self._ends = [e for e in self._ends if e[0] > begin]  # text already sent needs no source any more
        segments: list[tuple[str, str]] = []
        for end, source in self._ends:
            end = min(end, stop)
            if end > position:
                segments.append((text[position - begin: end - begin], source))
                position = end
        if position < stop:  # text past the last token's recorded end (a later decode merged bytes)
            segments.append((text[position - begin:], self._ends[-1][1] if self._ends else "target"))
        return StreamDelta(text, segments, token_ids, sources)

    def _hit_stop(self) -> bool:
        # A stop string that just appeared ends in the last token's text: decode only the tokens that hold the
        # longest one. Tokens and characters do not pair up (a byte-level token may be a third of a character, a
        # special token decodes to nothing), so the tail grows until its text before the last token is long enough
        # (a cut character at its start decodes to up to 3 replacement characters; the last token's own text may be
        # long, and counting it missed a stop string that began behind a run of special tokens).
        longest = max(len(s) for s in self.stop)
        n = longest + 8
        while True:
            if len(self._decode(self.token_ids[-n:-1])) >= longest + 3 or n >= len(self.token_ids):
                break
            n *= 2
        tail = self._decode(self.token_ids[-n:])
        if not any(s in tail for s in self.stop):
            return False
        text = self._decode(self.token_ids)
        self._text = text[: min(text.find(s) for s in self.stop if s in text)]  # vLLM-like: stop string cut
        return True

    def _pending_text(self, final: bool) -> str:
        end = len(self._text)
        if not final:
            # Hold back what may still change: trailing replacement chars (the first bytes of a multi-byte
            # character) and a tail that could be the start of a stop string (it would be cut).
            end = len(self._text.rstrip("\ufffd"))
            if self.stop:
                end -= max(len(s) for s in self.stop) - 1
        end = max(end, self._emitted)
        delta = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta


def stream(
    target: LoadedModel | Transformer,
    prompt: Prompt,
    *,
    draft: LoadedModel | Transformer | str | None = None,
    method: str | None = None,
    temperature: float | None = 0.0,
    top_k: int | None = 0,
    top_p: float | None = 1.0,
    seed: int | None = None,
    max_new_tokens: int = 128,
    stop: str | Sequence[str] | None = (),
    raw: bool = False,
    ignore_eos: bool = False,
    prefix_cache: PrefixCache | None = None,
    **options: Any,
) -> GenerationStream:
    """Like :func:`generate`, but returns an iterator of text deltas (``.result`` is set at the end). Every
    argument and option is checked here, before the first token. ``ignore_eos`` (vLLM's and llama.cpp's extension):
    decode past EOS, keeping it as output, up to ``max_new_tokens`` (what load generators ask for fixed lengths).
    ``prefix_cache``: a :class:`~mirrorsd.prefix_cache.PrefixCache` of the target; the prompt's longest stored
    prefix is not prefilled again, and the request's own keys and values are stored when it ends. ``draft`` may be
    ``"self:N"`` / ``"self:F"``, the target's first N layers (or that fraction of them), as the CLI's ``--draft``."""
    target = _as_loaded(target)
    if isinstance(draft, str) and draft.startswith(SELF_DRAFT):
        draft = self_draft(target, draft)
    # None means the default, as OpenAI's clients send it
    temperature, top_k, top_p = (0.0 if temperature is None else temperature, 0 if top_k is None else top_k,
                                 1.0 if top_p is None else top_p)
    stop = () if stop is None else stop
    if seed is not None and (not is_integer(seed) or not -(2**63) <= seed < 2**63):  # (before auto's plan; 1.7 and
        raise OptionError("seed", f"must be an integer in [-2**63, 2**63), got {seed!r}")  # True became 1)
    if not isinstance(stop, str) and not (isinstance(stop, Sequence) and all(isinstance(x, str) for x in stop)):
        raise OptionError("stop", f"must be a string or a list of strings, got {stop!r}")
    if prefix_cache is not None and prefix_cache.model is not target.model:
        raise ValueError("prefix_cache belongs to another model than the target")
    # What does not depend on the method is checked before auto plans (1-2 minutes on first use)
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise OptionError("max_new_tokens", f"must be an integer >= 1, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    ids = encode_prompt(target, prompt, raw=raw)
    context = target.config.context_length
    if len(ids) >= context:
        raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {context}")
    if seed is None:  # like HF and vLLM, no seed means a fresh one; it is reported in the stats
        seed = secrets.randbits(63)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=int(seed))
    method = method or default_method(draft)
    if method == "auto":
        method, options, draft = planned(target, draft, options)
    spec = get_method(method)
    exact_windows(target.model, method)
    draft_model = bridge = None
    if spec.needs_draft:
        if draft is None:
            raise ValueError(f"method {method!r} needs a draft model (draft=... / --draft)")
        draft = _as_loaded(draft, "draft")
        bridge = draft_bridge(method, target, draft)
        draft_model = draft.model
    elif draft is not None:
        raise ValueError(f"method {method!r} does not use a draft model")
    shape = ModelShape(target.config.n_layers, target.config.vocab_size)
    opts = spec.options.parse(options, method, shape).resolved(ZooFiles(target, draft), shape)
    if getattr(target.model, "tp_size", 1) > 1:
        shares = draft_model is not None and draft_model.layers[0] is target.model.layers[0]  # (a prefix_model)
        spec.check_tensor_parallel(opts, self_draft=shares)
    max_new = min(max_new_tokens, context - len(ids))
    short = draft_model.config.context_length if draft_model is not None else context
    if opts.draft_positions(len(ids), max_new) > short:  # the draft would stop drafting, or its cache overflow
        room = short - opts.draft_positions(len(ids), 0)
        raise ValueError(f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new}, but the draft's context "
                         f"is {short} tokens (the target's {context}): give "
                         f"{f'max_new_tokens <= {room}, ' if room > 0 else ''}a draft with a longer context, or a "
                         "method without a draft")
    stats = GenerationStats(method, seed=params.seed)
    request = DecodeRequest(target.model, ids, max_new, params, stats, draft_model, opts, bridge, prefix_cache)
    roles = spec.build(request, opts)  # checks the models against the options now, not at the first token
    return GenerationStream(target, ids, run(request, roles), request, stop, ignore_eos)


def windows_exact(model: Transformer) -> bool:
    """Whether a window's rows get the bits one row gets alone: not on a CPU in bfloat16 or float16, which run through
    PyTorch's GEMM and attention (our C++ path, which keeps a row's bits whatever rides with it, takes float32 and the
    quantized formats); a window's logits differed from one token's by up to 0.38 there, enough to change greedy
    tokens."""
    return model.device.type != "cpu" or model.dtype == torch.float32


def exact_windows(model: Transformer, method: str) -> None:
    """Refuses speculation where :func:`windows_exact` does not hold. ``ar`` reads one row a step, and stays the
    reference."""
    if method != REFERENCE and not windows_exact(model):
        dtype = str(model.dtype).removeprefix("torch.")
        raise ValueError(f"method {method!r} cannot be exact with {dtype} weights on a CPU: a verification window's "
                         "rows there do not get the bits one row gets alone (our CPU kernels take float32 and the "
                         "quantized formats); load the model in float32, q8 or q4 (the defaults), or use method 'ar'")


def generate(target: LoadedModel | Transformer, prompt: Prompt, **kwargs: Any) -> Generation:
    """Generate a completion.

    ``method``: a registered method (``mirrorsd methods`` lists them with their options: ``ar``, ``sd``,
    ``mirror``, ``ss``), or ``"auto"`` (what `mirrorsd plan` recommended for this target and draft); default
    ``sd`` when a ``draft`` is given, else ``ar``. Method options are keyword arguments (``gamma=4``), checked
    by the method's options class (e.g. :class:`mirrorsd.decoding.mirror.MirrorOptions`); ``ss`` defaults
    ``streams`` to the target's shipped adapter, and ``sd`` and ``mirror`` take ``draft_streams=True`` for the draft's.
    ``temperature=0`` is greedy; sampling noise is keyed by ``seed`` (random when None) and position, so ``ar``
    and the speculative methods with match acceptance give the same tokens for the same seed -- up to float
    near-ties, where a k-token and a 1-token forward may order two almost equal logits differently.
    """
    s = stream(target, prompt, **kwargs)
    for _ in s:
        pass
    assert s.result is not None
    return s.result


WARM_UP_PROMPT = "Hello"  # (a bare model without a tokenizer reads WARM_UP_IDS)
WARM_UP_IDS = (1, 2, 3, 4)


def warm_up(target: LoadedModel | Transformer, *, method: str, draft: LoadedModel | Transformer | None = None,
            max_new_tokens: int = 4, **options: Any) -> float:
    """One short greedy generation with ``method`` and ``options`` (past an EOS, so its decoding steps run too),
    answered to nobody; returns its seconds.

    Why: a method's first request in a process pays its one-time work (``ss`` imports peft and builds its stream
    head: 6.4 s against 0.7 s for the next request, the 1.5B on a 2-core CPU), so without this a server's first
    user waits for it and a load sweep's first round measures it (llama.cpp's server warms up the same way). The
    suffix indexes are isolated, so the warm-up's answer is neither looked up later nor persisted; and the calling
    thread's OpenMP team is ended after it, since the real requests' forwards run on other threads
    (:func:`~mirrorsd.execution.release_thread_team`)."""
    start = time.perf_counter()
    try:
        prompt = WARM_UP_PROMPT if _as_loaded(target).tokenizer is not None else list(WARM_UP_IDS)
        with isolated_shared_indexes():
            generate(target, prompt, raw=True, method=method,
                     draft=draft if method == "auto" or get_method(method).needs_draft else None,
                     max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **options)
    finally:
        release_thread_team()
    return time.perf_counter() - start
