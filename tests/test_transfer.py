"""Host <-> device copies: ``read_all`` gives each tensor's own ``tolist`` from one copy; ``send`` keeps values."""

from __future__ import annotations

import torch

from mirrorsd.transfer import read_all, send


def test_read_all_gives_each_tensors_own_tolist():
    tensors = [torch.arange(6).view(2, 3), torch.rand(2, 0), torch.rand(3, 2, 2), torch.tensor([True, False]),
               torch.zeros(0, 4, dtype=torch.long), torch.tensor(7), torch.tensor([151_935, 0, 2**40]),
               torch.randn(5).to(torch.bfloat16).float()]
    got = read_all(*tensors)
    assert got == [t.tolist() for t in tensors]
    assert [type(x) for x in got[6]] == [int] * 3 and isinstance(got[5], int)
    assert read_all() == []


def test_send_keeps_values_and_dtype():
    assert send([3, 1, 4], "cpu").tolist() == [3, 1, 4] and send([3], "cpu").dtype == torch.long
    mask = torch.tensor([[True, False]])
    assert torch.equal(send(mask, "cpu"), mask)
