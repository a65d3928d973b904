"""Peers timed in the same run as our methods, on the same prompts and the same weights.

* HF transformers ``generate``: plain (``hf-ar``), ``assistant_model=`` (``hf-assisted``) and
  ``prompt_lookup_num_tokens=`` (``hf-pld``, Spec-Bench's settings: 10 candidate tokens, 3-gram match), on the
  fp32 checkpoint the zoo converted from the GGUF file (transformers cannot run GGUF codes directly).
* llama.cpp's ``llama-server`` on the very GGUF files our q4 format computes from: one server without a draft
  (``llama-server-ar``), one with ``--model-draft`` (``llama-server``) and, for ``llama-server-ngram``, one per
  configuration with a draft-free n-gram ``--spec-type`` (default ``ngram-simple``; every option of the method is
  a llama-server flag: ``llama-server-ngram:spec-type=ngram-mod:spec-draft-n-max=16``), over loopback HTTP, prompt
  cache off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..runtime import synchronize
from ..runtime.processes import free_port
from ..sampling import SamplingParams
from .metrics import Turn

HF_METHODS = {"hf-ar", "hf-assisted", "hf-pld"}
LLAMA_METHODS = {"llama-server", "llama-server-ar", "llama-server-ngram"}
NGRAM_SPEC_TYPE = "ngram-simple"  # llama.cpp's first n-gram map type (docs/speculative.md)
PLD_TOKENS, PLD_NGRAM = 10, 3  # Spec-Bench's PLD settings (draft_num_candidate_tokens, matching window)



def truncated(target, draft) -> bool:
    """Whether ``draft`` is the target's own first layers (``self:N``): the target's files, fewer layers."""
    return draft.path == target.path and draft.config.n_layers < target.config.n_layers


@contextmanager
def quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


class HFPeers:
    """HF models loaded once, on the device and dtype of our target."""

    def __init__(self, target, draft, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.eos = sorted(target.eos_token_ids)
        self.model = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).to(self.device).eval()
        self.assistant = None
        if draft is not None and draft.path is not None:
            # a self:N draft is the target's folder read through its first N layers (then its final norm and head,
            # as ours): HF's assistant must be that too, not the whole target
            layers = {"num_hidden_layers": draft.config.n_layers} if truncated(target, draft) else {}
            with quiet_transformers():  # (its checkpoint's later layers go unused, on purpose)
                self.assistant = AutoModelForCausalLM.from_pretrained(draft.path, dtype=dtype, **layers)
            self.assistant = self.assistant.to(self.device).eval()

    @torch.inference_mode()
    def generate(self, method: str, ids: list[int], max_new: int, params: SamplingParams,
                 options: dict[str, Any]) -> Turn:
        x = torch.tensor([ids], device=self.device)
        kw: dict[str, Any] = dict(options)
        if method == "hf-assisted":
            if self.assistant is None:
                raise ValueError("hf-assisted needs a draft model loadable by transformers (a zoo name or folder)")
            kw["assistant_model"] = self.assistant
        elif method == "hf-pld":
            kw.setdefault("prompt_lookup_num_tokens", PLD_TOKENS)
            kw.setdefault("max_matching_ngram_size", PLD_NGRAM)
        if not params.greedy:
            torch.manual_seed(params.seed)
            kw |= {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
        else:
            kw["do_sample"] = False
        synchronize(self.device)
        start = time.perf_counter()
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                  eos_token_id=self.eos, pad_token_id=self.eos[0], **kw)
        synchronize(self.device)
        wall = time.perf_counter() - start
        new = out[0, len(ids):].tolist()
        for i, t in enumerate(new):  # like ours, the EOS id ends the output and is not counted
            if t in self.eos:
                new = new[:i]
                break
        return Turn(new_tokens=len(new), wall_s=wall, token_ids=new)

    @torch.inference_mode()
    def logit_gap(self, prefix: list[int], expected: int, got: int) -> float:
        logits = self.model(torch.tensor([prefix], device=self.device)).logits[0, -1].float()
        return float(logits[expected] - logits[got])


def find_llama_server(path: str | None = None) -> str | None:
    """``path``, else ``$MIRRORSD_LLAMA_SERVER``, else ``llama-server`` on PATH."""
    candidate = path or os.environ.get("MIRRORSD_LLAMA_SERVER") or shutil.which("llama-server")
    return candidate if candidate and Path(candidate).is_file() else None


def server_flags(options: dict[str, Any]) -> list[str]:
    """A ``llama-server-ngram`` method's options as llama-server flags (``spec_type`` -> ``--spec-type``); a switch
    is ``key=true`` (given alone) or ``key=false`` (left out)."""
    flags: list[str] = []
    for key, value in {"spec_type": NGRAM_SPEC_TYPE, **options}.items():
        if value is False:
            continue
        flags += ["--" + key.replace("_", "-"), *([] if value is True else [str(value)])]
    return flags


class LlamaServer:
    """One ``llama-server`` process on loopback; ``draft`` adds ``--model-draft`` (its speculative decoding);
    ``parallel`` slots batch that many requests continuously (``-np``), sharing ``context`` tokens."""

    def __init__(self, binary: str, model: Path, draft: Path | None, threads: int, context: int,
                 extra_args: list[str] | None = None, log: Path | None = None, parallel: int = 1) -> None:
        self.port = free_port()
        self.command = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t",
                        str(threads), "-c", str(context), "-np", str(parallel), "--no-cache-prompt", "--no-webui",
                        *(["--model-draft", str(draft)] if draft else []), *(extra_args or [])]
        self._log = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.process.returncode}: "
                                   f"{' '.join(self.command)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server did not become ready in {timeout:.0f} s")

    def complete(self, ids: list[int], max_new: int, params: SamplingParams, eos: frozenset[int]) -> Turn:
        body = {"prompt": ids, "n_predict": max_new, "temperature": params.temperature, "seed": params.seed % 2**32,
                "cache_prompt": False, "return_tokens": True, "stream": False, "top_k": params.top_k,
                "top_p": params.top_p, "min_p": 0.0}  # (llama.cpp's own default filters off: the same law as ours)
        if params.greedy:
            body["top_k"] = 1  # greedy: the argmax token (llama.cpp's sampler chain keeps only the top one)
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as r:
            reply = json.loads(r.read())
        wall = time.perf_counter() - start
        timings = reply.get("timings", {})
        if "tokens" not in reply and timings.get("predicted_n", 0) > 0:  # (no ids: nothing to check or count)
            raise RuntimeError("llama-server's reply has no token ids (`return_tokens`): this build is too old to "
                               "check against; build a newer llama.cpp")
        tokens = [t for t in reply.get("tokens", []) if t not in eos]
        counters = {k: float(timings[k]) for k in ("draft_n", "draft_n_accepted") if k in timings}
        return Turn(new_tokens=len(tokens), wall_s=wall, token_ids=tokens, text=reply.get("content", ""),
                    prefill_s=timings.get("prompt_ms", 0.0) / 1e3, counters=counters)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
