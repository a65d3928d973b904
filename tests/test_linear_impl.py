"""The linear-layer implementation is called ``linear`` everywhere ("backend" is Mirror-SD's executor)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import mirrorsd
from mirrorsd import Transformer, cli
from mirrorsd.bench.forward import ForwardReport
from mirrorsd.linear import LINEAR_IMPLS, DenseLinear
from tests.helpers import tiny_hf


def test_linear_is_the_parameter_name_everywhere() -> None:
    assert LINEAR_IMPLS == ("auto", "dense")
    for fn in (mirrorsd.load_model, Transformer.from_pretrained, Transformer.from_hf, Transformer.__init__):
        params = inspect.signature(fn).parameters
        assert "linear" in params and "backend" not in params, fn
    fields = {f.name for f in dataclasses.fields(ForwardReport)}
    assert "linear" in fields and "backend" not in fields


def test_bench_forward_takes_linear_not_backend(capsys) -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["bench", "forward", "--linear", "dense"]).linear == "dense"
    assert parser.parse_args(["bench", "forward"]).linear == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "forward", "--backend", "dense"])
    capsys.readouterr()


def test_dense_linear_builds_only_dense_layers() -> None:
    model = Transformer.from_hf(tiny_hf(layers=2), linear="dense")
    projections = [m for m in model.modules() if "Linear" in type(m).__name__]
    assert projections and all(isinstance(m, DenseLinear) for m in projections)
    with pytest.raises(ValueError, match="linear must be one of"):
        Transformer.from_hf(tiny_hf(layers=1), linear="threads")
