"""The CUDA attention kernel's logic on the CPU, through Triton's interpreter (in a subprocess, which sets
``TRITON_INTERPRET=1`` before Triton loads). Skipped where Triton is not installed; ``tests/test_cuda.py`` runs
the compiled kernel on a GPU. (Triton 3.6's interpreter needs numpy < 2.3: newer numpy refuses its 1-element
loop bounds; the dev extra installs 3.9.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers import REPO

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernel (tests/test_cuda.py)"),
]

KERNEL = """
import torch, torch.nn.functional as F
from mirrorsd.kernels import cuda_attention as ca

torch.manual_seed(0)
past, t = PAST, 5
q = torch.randn(1, t, 4, 16).transpose(1, 2)
k, v = torch.randn(1, 2, past + t, 16), torch.randn(1, 2, past + t, 16)
ticket = ca.tickets(t * 4, q.device)
mask = torch.zeros(1, t, past + t, dtype=torch.bool)
mask[..., :past] = True
for i, j in [(0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3), (4, 2), (4, 3), (4, 4)]:
    mask[0, i, past + j] = True
for m in (None, mask):
    out = ca.attend(q, k, v, *ca.visible_keys(m, t, past + t, q.device), ticket=ticket)
    assert not ticket.any()  # the merging splits gave their tickets back
    for i in range(t):
        seen = torch.arange(past + i + 1) if m is None else m[0, i].nonzero().squeeze(1)
        want = F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, seen], v[:, :, seen], enable_gqa=True)
        assert torch.allclose(out[:, :, i : i + 1], want, atol=1e-5), (out[:, :, i : i + 1] - want).abs().max()
        alone = ca.attend(q[:, :, i : i + 1].contiguous(), k[:, :, seen], v[:, :, seen],
                          *ca.visible_keys(None, 1, len(seen), q.device))
        assert torch.equal(alone, out[:, :, i : i + 1])
print("ok")
"""

def _interpret(code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.parametrize("past", [40, 70, 1100])
def test_kernel_matches_sdpa_and_one_query_calls(past):
    """Windows and trees: close to SDPA over each query's visible keys, and bit-equal to that query alone. At 40
    keys a query is one program; at 70 two splits of one block, merged by the last to finish; at 1,100 every
    split walks one or two blocks."""
    from mirrorsd.kernels.cuda_attention import BLOCK_KEYS, SPLITS

    assert 40 + 5 <= BLOCK_KEYS < 70 < BLOCK_KEYS * SPLITS < 1100 < 2 * BLOCK_KEYS * SPLITS
    _interpret(KERNEL.replace("PAST", str(past)))


GRAPHED = """
import torch
import mirrorsd.execution, mirrorsd.linear, mirrorsd.model
from mirrorsd import Transformer
from mirrorsd.kernels import cuda_attention
from tests.helpers import tiny_hf
from tests.helpers import assert_graphed_windows_decode_bit_for_bit

for module in (mirrorsd.execution, mirrorsd.linear, mirrorsd.model):
    module.fixed_shapes = lambda x: True
cuda_attention.applies = lambda q: True
cuda_attention.serves = lambda device, head_dim: True
model = Transformer.from_hf(tiny_hf(vocab=100, std=0.1), linear="dense")
assert_graphed_windows_decode_bit_for_bit(model, torch.randint(0, 100, (62,)).tolist(), model.prefix_model(1))
print("ok")
"""


@pytest.mark.slow  # ~3 min interpreted; tests/kernels/test_cuda_layers.py's methods test replays static inputs too
def test_windows_through_static_inputs_decode_bit_for_bit():
    """What a captured CUDA graph runs, run eagerly on the CPU (see ``assert_graphed_windows_decode_bit_for_bit``)."""
    _interpret(GRAPHED)
