"""Adding a method is one new file: ``tests/decoding/example_method.py`` registers ``ngram-example`` (prompt lookup, no
draft model) and the API, ``mirrorsd methods``, ``mirrorsd generate``, ``mirrorsd bench --methods`` and the
planner take it with no edit of theirs. (``tests/decoding/test_conformance.py`` runs its conformance tests too.)"""

from __future__ import annotations

import json

import pytest
import torch

from mirrorsd import generate
from mirrorsd.bench import plan
from mirrorsd.bench.runner import parse_methods
from mirrorsd.cli import build_parser, main
from mirrorsd.decoding import get_method, methods, register
from tests.helpers import requires_smollm2, row_exact, tiny_hf

from .example_method import METHOD, NAME, NgramOptions, build, lookup, step_cost

BUILT_IN = {"ar": False, "sd": True, "mirror": True, "ss": False}  # name -> needs a draft


@pytest.fixture(scope="module")
def model():
    return row_exact(tiny_hf(layers=4, seed=1))  # row-exact: k-token forwards equal 1-token ones bit for bit


@pytest.fixture
def one_thread():
    """A tiny model's forwards are microseconds of work: a second intra-op thread only adds barrier waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_example_is_registered():
    assert NAME in [m.name for m in methods()]
    assert get_method(NAME) is METHOD
    assert not METHOD.needs_draft and not METHOD.rejection
    assert [o.name for o in NgramOptions.fields()] == ["gamma", "ngram"]


def test_lookup_proposes_what_followed_the_latest_occurrence():
    assert lookup([1, 2, 3, 9, 1, 2, 4, 1, 2], 2, 5) == [4, 1, 2]  # the latest earlier [1, 2] is followed by 4
    assert lookup([1, 2, 3, 9, 1, 2, 4, 1, 2], 2, 1) == [4]  # at most the window
    assert lookup([5, 2, 7, 3, 2], 2, 3) == [7, 3, 2]  # [3, 2] never occurred before: [2] did
    assert lookup([5, 2, 7, 3, 2], 1, 3) == [7, 3, 2]
    assert lookup([1, 2, 3], 2, 3) == [] and lookup([4], 2, 3) == []


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.7, "top_p": 0.9,
                                                                             "seed": 11}])
def test_the_example_equals_ar(model, one_thread, sampling):
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    want = generate(model, prompt, method="ar", max_new_tokens=30, **sampling)
    got = generate(model, prompt, method=NAME, gamma=3, max_new_tokens=30, **sampling)
    assert got.token_ids == want.token_ids
    stats = got.stats
    assert stats.method == NAME and stats.gamma == 3 and stats.max_drafted <= 3
    assert sum(stats.drafted) > 0  # the lookup did propose
    assert sum(a + 1 for a in stats.accepted) == 30
    with pytest.raises(ValueError, match="gamma"):
        generate(model, prompt, method=NAME, gamma=0)
    with pytest.raises(ValueError, match="does not use a draft"):
        generate(model, prompt, method=NAME, draft=model)


def _described(capsys) -> list[dict]:
    assert main(["methods", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_methods_json_lists_the_example(capsys):
    by_name = {m["name"]: m for m in _described(capsys)}
    example = by_name[NAME]
    assert example["needs_draft"] is False
    assert [(o["name"], o["flag"], o["default"]) for o in example["options"]] == [("gamma", "--gamma", 4),
                                                                                  ("ngram", "--ngram", 2)]


def test_methods_json_describes_every_method_with_help_and_flags(capsys):
    described = _described(capsys)
    assert isinstance(described, list)
    by_name = {m["name"]: m for m in described}
    for name, needs_draft in BUILT_IN.items():
        assert by_name[name]["needs_draft"] is needs_draft
    for m in described:
        assert {"name", "needs_draft", "options"} <= set(m)
        for o in m["options"]:
            assert o["help"].strip(), (m["name"], o["name"])
            assert o["flag"].startswith("--"), (m["name"], o["name"])
    assert by_name["ar"]["options"] == []
    assert {o["name"] for o in by_name["sd"]["options"]} >= {"gamma", "confidence", "schedule", "acceptance"}
    assert {o["name"] for o in by_name["mirror"]["options"]} >= {"gamma", "kappa", "exit_layer", "backend"}
    assert {o["name"] for o in by_name["ss"]["options"]} >= {"streams", "tree_k", "threshold"}


def test_generate_cli_takes_the_examples_flags(capsys):
    args = build_parser().parse_args(["generate", "--method", NAME, "--ngram", "2", "--prompt", "x"])
    assert args.method == NAME and args.prompt == "x"
    assert [v for k, v in vars(args).items() if k.endswith("ngram")] == ["2"]
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--ngram" in capsys.readouterr().out
    # Options are checked by the example's options class before any model loads; errors name the flag.
    assert main(["generate", "--method", NAME, "--ngram", "0", "--prompt", "x"]) == 2
    assert "--ngram must be >= 1, got 0" in capsys.readouterr().err
    assert main(["generate", "--method", "sd", "--ngram", "2", "--prompt", "x"]) == 2
    assert f"--ngram does not apply to --method sd (it is an option of: {NAME})" in capsys.readouterr().err


def test_bench_parses_and_types_the_examples_options():
    specs = parse_methods(f"{NAME}:gamma=4:ngram=1")
    assert [s.kind for s in specs] == ["ar", NAME]  # the ar reference is added
    options = specs[1].options
    assert options == {"gamma": 4, "ngram": 1} and type(options["gamma"]) is int
    with pytest.raises(ValueError, match="gamma"):
        parse_methods(f"{NAME}:gamma=0")
    with pytest.raises(ValueError, match="ngram"):
        parse_methods(f"{NAME}:ngram=two")
    with pytest.raises(ValueError, match="not an option"):
        parse_methods(f"{NAME}:kappa=2")


class _Costs:
    """A cost table where a target forward over ``rows`` tokens takes ``10 + rows`` ms."""

    def target(self, rows: float) -> float:
        return 10.0 + rows


def test_the_planner_prices_the_example_through_its_step_cost():
    steps = [{"drafted": 0, "accepted": 0}, {"drafted": 3, "accepted": 2}]
    assert plan.turn_time(_Costs(), NAME, steps, 0.5, {"gamma": 3}) == pytest.approx(0.5 + (11 + 14) / 1e3)


def test_registering_a_name_twice_with_another_definition_raises():
    other = NgramOptions
    with pytest.raises(ValueError, match="registered already"):
        register(NAME, "another method under the same name", needs_draft=False, options=other, build=build)
    with pytest.raises(ValueError, match="registered already"):
        register(NAME, METHOD.summary, needs_draft=True, options=other, build=build, step_cost=step_cost)
    assert get_method(NAME) is METHOD  # the first definition stands
    # The same definition again (a module imported twice) is accepted.
    same = register(NAME, METHOD.summary, needs_draft=False, options=NgramOptions, build=build, step_cost=step_cost)
    assert same == METHOD and [m.name for m in methods()].count(NAME) == 1


@pytest.mark.real
@requires_smollm2
def test_cli_generates_with_the_example_on_real_weights(capsys):
    common = ["generate", "--target", "smollm2-135m", "--prompt", "List the planets of the solar system.",
              "--max-new-tokens", "24", "--json"]
    out = {}
    for method, extra in (("ar", []), (NAME, ["--gamma", "3", "--ngram", "1"])):
        assert main([*common, "--method", method, *extra]) == 0
        out[method] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out[NAME]["token_ids"] == out["ar"]["token_ids"]
    assert out[NAME]["stats"]["method"] == NAME and out[NAME]["stats"]["gamma"] == 3
