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
from mirrorsd.decoding import OptionError, get_method, methods, register
from mirrorsd.decoding.mirror.options import MAX_ROLLOUT_ROWS
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


def _parsed(method: str, **values):
    return get_method(method).options.parse(values, method)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf", "nan", "Infinity"])
def test_a_float_option_must_be_finite(model, one_thread, value):
    """inf passed suffix's `factor > 0` (a string from the command line, or JSON's Infinity in a request) and sized a
    window with math.ceil(inf): an OverflowError, a server's 500. The registry refuses it for every option."""
    with pytest.raises(OptionError, match=r"^factor must be a finite number"):
        _parsed("suffix", factor=value)
    with pytest.raises(OptionError, match=r"^exit_layer must be a finite number"):
        _parsed("mirror", exit_layer=value)
    with pytest.raises(OptionError, match="factor"):  # (the API: it reached the lookup's window before)
        generate(model, [1, 2, 3, 1, 2, 3, 1, 2], method="suffix", factor=value, max_new_tokens=8)
    assert _parsed("suffix", factor=1e300).factor == 1e300  # (large is no error: the window is capped by gamma)


@pytest.mark.parametrize("value", [[2, 1], [3], (0.5,), {"a": 1}, True, False])
def test_an_option_with_its_own_parser_refuses_other_shapes(value):
    """Mirror-SD's exit_layer (a layer or a fraction) took a JSON list or object to a TypeError inside its checks
    (a server's 500) and true as layer 1."""
    with pytest.raises(OptionError, match=r"^exit_layer must be a layer index or a fraction, got "):
        _parsed("mirror", exit_layer=value)


def test_an_option_with_its_own_parser_takes_what_its_text_says():
    exit_layer = lambda value: _parsed("mirror", exit_layer=value, backend="threads").exit_layer  # noqa: E731
    assert exit_layer(0.25) == 0.25 and exit_layer("0.25") == 0.25
    assert exit_layer(3) == 3 and type(exit_layer(3)) is int
    for threads in ([2, 1], (2, 1), "2,1"):  # (JSON's list, the API's tuple, the command line's text)
        assert _parsed("mirror", backend="threads", threads=threads).threads == (2, 1)
    for threads in (4, [4], [2, 1, 1], True, [True, 1], {"target": 2}):  # (the API's threads=4 was a TypeError)
        with pytest.raises(OptionError, match=r"^threads must be TARGET,DRAFT thread counts, got "):
            _parsed("mirror", backend="threads", threads=threads)


def test_a_required_option_is_refused_when_the_options_are_parsed():
    """eagle's head was checked only when the method built, after the models loaded (and a server started without
    it failed every request)."""
    with pytest.raises(OptionError, match=r"^head is required: a folder from `mirrorsd train-eagle` \(--head FOLDER\)"):
        _parsed("eagle", gamma=3)
    assert _parsed("eagle", head="folder").head == "folder"


def test_mirror_caps_the_rows_a_step_rolls_out():
    """(γ+1)·κ branches of γ tokens each: with roots=paper, κ = 49152 rolled out 393216 branches a step, ~77 GB of
    logits. Capped as ss caps its whole tree; a fixed budget or the serial backend's fitted none count what runs."""
    with pytest.raises(OptionError, match=rf"^kappa 49152 with gamma 7 rolls out 393216 branches of 7 tokens in every "
                                          rf"step, 2752512 draft rows \(at most {MAX_ROLLOUT_ROWS}"):
        _parsed("mirror", kappa=49152, roots="paper")
    with pytest.raises(OptionError, match=r"^gamma 100 with kappa 1 rolls out 101 branches"):
        _parsed("mirror", gamma=100, kappa=1, backend="threads")
    assert _parsed("mirror", gamma=4, kappa=64, roots="paper").rollout_rows() == 5 * 64 * 4  # (test_mirror's)
    assert _parsed("mirror", kappa=49152, budget=8, backend="threads").rollout_rows() == 8 * 7
    assert _parsed("mirror", gamma=100).rollout_rows() == 0  # serial, fitted budget: nothing rolls out
    with pytest.raises(OptionError, match=r"^gamma 1000000 with kappa 8 rolls out 1 branches"):  # (kappa unset:
        _parsed("mirror", gamma=10**6, backend="threads", budget=1)  # the budget sets the roots, kappa was blamed)


def test_every_listed_flag_is_a_spec_key():
    """`mirrorsd methods` says its flags are the keys `bench --methods KIND:key=value` takes: ss's --tree-depth and
    --prune-threshold were refused there (their options are named depth and threshold), and are taken now, as are
    the names."""
    for method in methods():
        for o in method.options.fields():
            for key in (o.flag.removeprefix("--"), o.name, o.name.replace("_", "-")):
                assert method.options.named(key) == o.name, (method.name, key)
    specs = {s.label: s for s in parse_methods("a=ss:tree-depth=2:prune-threshold=0.1,b=ss:depth=2:threshold=0.1")}
    assert specs["a"].options == specs["b"].options == {"depth": 2, "threshold": 0.1}


def test_the_methods_listing_shows_an_options_name_where_its_flag_differs(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "  --tree-depth (depth) (default: γ)" in out and "  --prune-threshold (threshold) (default: " in out
    assert "  --tree-k (default: " in out  # (the name is the flag's)
