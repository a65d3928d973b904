"""The method registry: every decoding method registers its name, whether it needs a draft, a typed options
dataclass (defaults, help, validation, the shipped files it defaults to, whether it can run tensor-parallel), how
to build its roles, its cost model and what it offers the planner, once. The API validates through it, the CLI
builds ``--method`` choices and per-method flags from it, ``mirrorsd bench`` parses ``KIND:key=value`` with it,
the planner asks it for each method's candidates, and ``mirrorsd methods`` lists it. No code outside
``decoding/`` names a method.

A new method is one new module that calls :func:`register` (see ``tests/decoding/test_registry.py``'s example).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self

from ..errors import OptionError
from ..sampling import is_integer
from .engine import Roles

__all__ = ["OptionError"]  # re-exported: methods raise it from their option checks

# -- options --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One method option, read from a field of the method's options dataclass."""

    name: str
    default: Any
    help: str
    parse: Callable[[str], Any]  # from a command-line / bench string
    choices: tuple[Any, ...] | None = None
    check: tuple[Callable[[Any], bool], str] | None = None  # (accepts, "must be ...") on non-None values
    flag: str = ""  # the CLI flag; several methods may share one (``--gamma``)
    metavar: str | None = None
    const: Any = None  # value of the flag given without an argument (``--draft-streams``)
    default_text: str | None = None  # what a None default means (``the target's shipped adapter``)
    required: str = ""  # no default: what a request must give (refused, with these words, when it gives none)

    @property
    def shown_default(self) -> str:
        return "required" if self.required else self.default_text or str(self.default)

    @property
    def kind(self) -> str:
        """What a value must be, as an error says it."""
        return {int: "an integer", float: "a number"}.get(self.parse) or getattr(self.parse, "kind", "valid")

    def convert(self, value: Any) -> Any:
        """A Python value, parsing strings for non-string options and checking it."""
        given = value
        if self.parse not in (str, int, float):
            value = self._as_text(value)
        if isinstance(value, str) and self.parse is not str:
            try:
                value = self.parse(value)
            except ValueError:
                raise OptionError(self.name, f"must be {self.kind}, got {given!r}") from None
            if isinstance(given, list | tuple) and not isinstance(value, tuple):  # ([3] is not layer 3)
                raise OptionError(self.name, f"must be {self.kind}, got {given!r}")
        if value is None:
            return value
        value = self._typed(value)
        # inf passed every `> 0` and overflowed where it sized a window (a server's 500); NaN fails every comparison
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and not math.isfinite(value):
            raise OptionError(self.name, f"must be a finite number, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise OptionError(self.name, f"must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.check is not None and not self.check[0](value):
            raise OptionError(self.name, f"{self.check[1]}, got {value!r}")
        return value

    def _as_text(self, value: Any) -> Any:
        """A Python value (the API's, a request's JSON) of an option with a parser of its own, as the text that parser
        reads: a number or a list of them as the command line writes it (``exit_layer`` 0.5, ``threads`` [2, 1] as
        ``2,1``), so it is checked as that text is; other shapes (a bool, an object) are refused here, where they
        failed inside the checks (a server's 500) or passed as a number (true as layer 1)."""
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list | tuple):
            return ",".join(map(str, value))
        if isinstance(value, numbers.Number) and not isinstance(value, bool):
            return str(value)
        raise OptionError(self.name, f"must be {self.kind}, got {value!r}")

    def _typed(self, value: Any) -> Any:
        """A value given as a Python object (the API, a server request's JSON) of the option's type: a float or a list
        where an integer belongs failed deep inside decoding (a server's 500)."""
        if self.parse is int and not is_integer(value):
            raise OptionError(self.name, f"must be an integer, got {value!r}")
        if self.parse is float and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise OptionError(self.name, f"must be a number, got {value!r}")
        # JSON's other shapes where text belongs (objects the API passes, adapters or a head, go through)
        shaped = isinstance(value, numbers.Number | list | tuple | dict) and not isinstance(value, bool)
        if self.parse is str and (shaped or (isinstance(value, bool) and self.default is not None)):
            raise OptionError(self.name, f"must be text, got {value!r}")
        return int(value) if self.parse is int else value


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, check: tuple[Callable[[Any], bool], str] | None = None,
           flag: str | None = None, metavar: str | None = None, const: Any = None,
           default_text: str | None = None, required: str = "") -> Any:
    """A dataclass field carrying its :class:`Option` description (``parse`` defaults to the default's type)."""
    meta = {"help": help, "parse": parse or type(default), "choices": tuple(choices) if choices else None,
            "check": check, "flag": flag, "metavar": metavar, "const": const, "default_text": default_text,
            "required": required}
    return dataclasses.field(default=default, metadata={"option": meta})


def at_least(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f"must be >= {low}"


def probability(*, one: bool = False) -> tuple[Callable[[Any], bool], str]:
    """In [0, 1) (or [0, 1] with ``one``)."""
    return ((lambda v: 0 <= v <= 1), "must be in [0, 1]") if one else ((lambda v: 0 <= v < 1), "must be in [0, 1)")


@dataclass(frozen=True)
class ModelShape:
    """What option checks may need of the target before it is loaded (read from its config.json)."""

    n_layers: int
    vocab_size: int


class ShippedFiles(Protocol):
    """The files shipped for a request's models (stream adapters, tuned exits) that options default to. The API
    supplies them: the zoo's files live above this layer."""

    def streams(self, role: str) -> Path:
        """The shipped stream adapter of the ``"target"`` or the ``"draft"``; raises, naming the option, if none."""
        ...

    def tuned_exit(self, option: str) -> str:
        """The target's shipped tuned exit for ``option`` set to ``"tuned"``; raises, naming the option, if none."""
        ...

    def exit_for_layer(self, layer: int) -> str | None:
        """The target's shipped tuned exit with a translator for ``layer``, or None."""
        ...


@dataclass(frozen=True)
class MethodOptions:
    """Base of every method's options: ``parse`` builds and checks them from a mapping of names to values."""

    @classmethod
    def fields(cls) -> list[Option]:
        out = []
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("option")
            if meta is None:
                continue
            out.append(Option(f.name, f.default, flag=meta["flag"] or "--" + f.name.replace("_", "-"),
                              **{k: v for k, v in meta.items() if k != "flag"}))
        return out

    @classmethod
    def named(cls, key: str) -> str:
        """The option a spec's ``key=value`` names (``mirrorsd bench --methods``): its name, or its flag without the
        dashes as ``mirrorsd methods`` lists it (``tree-depth`` for ``depth``), ``-`` and ``_`` alike; an unknown key
        as given, for :meth:`parse` to refuse."""
        spelled = key.replace("-", "_")
        return next((o.name for o in cls.fields() if spelled in (o.name, o.flag.lstrip("-").replace("-", "_"))),
                    spelled)

    @classmethod
    def parse(cls, values: Mapping[str, Any], method: str, shape: ModelShape | None = None) -> MethodOptions:
        """Options from ``values`` (strings are parsed); None means the default. Unknown names are refused, and a
        required option not given (before any model loads, not when the method builds)."""
        fields = {o.name: o for o in cls.fields()}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            known = ", ".join(fields) or "none"
            raise OptionError(unknown[0], f"is not an option of method {method!r} (its options: {known})")
        given = {k: fields[k].convert(v) for k, v in values.items() if v is not None}
        missing = [o for o in fields.values() if o.required and o.name not in given]
        if missing:
            raise OptionError(missing[0].name, f"is required: {missing[0].required}")
        opts = cls(**given)
        opts.check(shape)
        return opts

    def check(self, shape: ModelShape | None) -> None:
        """Checks across options or against the target's shape (None: not known yet)."""

    def draft_positions(self, prompt: int, new: int) -> int:
        """The positions a draft model's cache reaches for a prompt and an answer of these lengths (its context
        must hold them): all of both, unless the method's draft reads less of the prompt."""
        return prompt + new

    def resolved(self, files: ShippedFiles, shape: ModelShape) -> Self:
        """These options with the defaults that name shipped files filled in (a request's, by the API)."""
        return self

    def check_tensor_parallel(self, self_draft: bool = False) -> None:
        """Every rank of a sharded target must take the same decisions, so no proposal may depend on timings: a
        method that can run tensor-parallel refuses here the options whose drafts do (:attr:`Method.tensor_parallel`
        says whether it can at all). ``self_draft``: the draft is the target's own first blocks, sharded with it."""
        if getattr(self, "suffix_match", 0):
            raise ValueError("a tensor-parallel target needs suffix_match=0 (--suffix-match 0): the suffix "
                             "proposer's windows depend on timings, which differ between ranks")

    def draft_ranks(self) -> bool:
        """Whether the draft runs in processes of its own: under ``torchrun``, the ranks after the target's serve it,
        and ``--draft-tp`` may shard it over them."""
        return False

    def check_draft_sharded(self) -> None:
        """Refuses the options a draft sharded over its ranks (``--draft-tp``) cannot follow, and every method whose
        draft has no ranks of its own."""
        raise ValueError("--draft-tp shards the draft's own processes: it takes --method mirror --backend processes")

    def unbatchable(self) -> str | None:
        """Why a request with these options must run alone rather than in a continuous batch (its forwards then wait
        on work outside the batch, a draft in another process or on another stream), or None: it batches."""
        return None

    def priced_layers(self, n_layers: int) -> tuple[int, ...]:
        """Target layers whose prefix cost (layers below them) the method's cost model reads."""
        return ()

    def to_dict(self) -> dict[str, Any]:
        return {o.name: getattr(self, o.name) for o in self.fields()}


# -- methods --------------------------------------------------------------------------------------------------


class CostTable(Protocol):
    """What the planner measured (:class:`mirrorsd.bench.plan.Costs`), as a method's cost model reads it."""

    def target(self, rows: float) -> float: ...  # ms of a target forward over ``rows`` tokens

    def draft(self, rows: float, vocab: int | None = 0) -> float: ...  # draft_vocab as the option gives it

    def draft_read(self, rows: float, vocab: int | None = 0) -> float: ...  # logits of the last row only

    def prefix(self, exit_layer: int, rows: float) -> float: ...  # target layers [0, ℓe)

    def exit_head(self, rows: float) -> float: ...

    def for_backend(self, backend: str) -> CostTable: ...

    @property
    def split(self) -> Mapping[str, Any] | None: ...  # the tables with the cores split (None: not measured)


StepCost = Callable[[CostTable, Mapping[str, Any], Any], float]  # (costs, one recorded step, options) -> ms


@dataclass(frozen=True)
class Priced:
    """One configuration the planner may recommend: its options, tokens per step and ms per step."""

    options: dict[str, Any]
    tokens_per_step: float
    step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.tokens_per_step / self.step_ms


class PlanInputs(Protocol):
    """What the planner measured (:mod:`mirrorsd.bench.plan`), as a method's :attr:`Method.plan` reads it."""

    costs: CostTable
    has_draft: bool
    quick: bool  # ``auto``'s first use: no split-thread tables, no hybrid runs
    files: ShippedFiles | None  # the target's shipped files (None: pricing without models)
    per_position: Sequence[float]  # the probe's per-position acceptance of the draft alone
    # fallback frequency by window size γ, exit layer, then κ (the probe's exit ranks): a shorter window's
    # correction fills an earlier slot, where the exit reads otherwise
    fallback: Mapping[int, Mapping[int, Mapping[int, float]]]
    gammas: Sequence[int]
    kappas: Sequence[int]
    backends: Sequence[str]

    def expected_tokens(self, gamma: int) -> float:
        """Committed tokens per step of a γ-token window at the probe's acceptance (E[A] + 1)."""
        ...

    def draft_prefill(self, read: int | None) -> float:
        """Ms per committed token the draft's prompt prefill adds when it reads ``read`` prompt tokens (None:
        all of them)."""
        ...

    def calibrated(self, method: str, options: dict[str, Any]) -> Priced | None:
        """Priced from the method's own short runs on the calibration prompts, where acceptance depends on the text
        (None when the planner prices without models)."""
        ...

    def runs(self, method: str, options: dict[str, Any], prompts: int, max_new: int) -> list[Any]:
        """The :class:`GenerationStats` of short runs on the first ``prompts`` calibration prompts (none when the
        planner prices without models)."""
        ...


#: A method's offers to the planner (empty where nothing was measured that prices it).
PlanOffers = Callable[[PlanInputs, "Method"], list[Priced]]


@dataclass(frozen=True)
class Method:
    """A registered decoding method.

    ``build(request, options)`` returns the engine roles for one request. ``step_cost`` is the planner's cost
    model: milliseconds of one recorded step (a dict from ``GenerationStats.step_log``); ``plan`` prices the
    configurations the method offers the planner. ``rejection`` says whether the method supports
    ``acceptance="rejection"`` (the conformance suite tests its distribution); ``bridged`` whether it takes a draft
    with a tokenizer of its own (:mod:`mirrorsd.decoding.bridge`); ``tensor_parallel`` whether its drafts are the
    same on every rank of a sharded target (:meth:`MethodOptions.check_tensor_parallel` refuses the options whose
    are not). ``exit_probe(target)``: for a method that reads an early exit, the call the planner times as the
    exit-head cost (:meth:`CostTable.exit_head`) on a window's hidden states.
    """

    name: str
    summary: str
    needs_draft: bool
    options: type[MethodOptions]
    build: Callable[[Any, Any], Roles]
    step_cost: StepCost | None = None
    rejection: bool = False
    bridged: bool = False
    tensor_parallel: bool = False
    plan: PlanOffers | None = None
    exit_probe: Callable[[Any], Callable[[Any], Any]] | None = None

    def price(self, costs: CostTable, step: Mapping[str, Any], **options: Any) -> float:
        """Ms of one step with these options, by the method's cost model."""
        return self.step_cost(costs, step, self.options.parse(options, self.name))

    def check_tensor_parallel(self, opts: MethodOptions, self_draft: bool = False) -> None:
        if not self.tensor_parallel:
            takes = ", ".join(m.name for m in methods() if m.tensor_parallel)
            raise ValueError(f"method {self.name!r} cannot run on a tensor-parallel target (its drafts depend on "
                             f"timings, which differ between ranks); use {takes}")
        opts.check_tensor_parallel(self_draft)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "summary": self.summary, "needs_draft": self.needs_draft,
                "rejection_sampling": self.rejection, "any_draft_tokenizer": self.bridged,
                "options": [{"name": o.name, "flag": o.flag, "default": _jsonable(o.default),
                             "default_text": o.shown_default, "help": o.help,
                             "choices": list(o.choices) if o.choices else None} for o in self.options.fields()]}


def _jsonable(value: Any) -> Any:
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)


class Registry:
    """Name -> :class:`Method`, in registration order."""

    _methods: ClassVar[dict[str, Method]] = {}

    @classmethod
    def add(cls, method: Method) -> Method:
        if method.name in cls._methods and cls._methods[method.name] != method:
            raise ValueError(f"method {method.name!r} is registered already")
        cls._methods[method.name] = method
        return method

    @classmethod
    def get(cls, name: str) -> Method:
        if name not in cls._methods:
            raise OptionError("method", f"must be one of {', '.join(cls._methods)}, got {name!r}")
        return cls._methods[name]

    @classmethod
    def all(cls) -> list[Method]:
        return list(cls._methods.values())


def register(name: str, summary: str, *, needs_draft: bool, options: type[MethodOptions],
             build: Callable[[Any, Any], Roles], step_cost: StepCost | None = None, rejection: bool = False,
             bridged: bool = False, tensor_parallel: bool = False, plan: PlanOffers | None = None,
             exit_probe: Callable[[Any], Callable[[Any], Any]] | None = None) -> Method:
    return Registry.add(Method(name, summary, needs_draft, options, build, step_cost, rejection, bridged,
                               tensor_parallel, plan, exit_probe))


def methods() -> list[Method]:
    return Registry.all()


def get_method(name: str) -> Method:
    return Registry.get(name)


def option_flag(key: str) -> str | None:
    """The CLI flag of the option a spec's ``key`` names (:meth:`MethodOptions.named`) in any method, or None."""
    for method in methods():
        name = method.options.named(key)
        flag = next((o.flag for o in method.options.fields() if o.name == name), None)
        if flag is not None:
            return flag
    return None


def split_specs(text: str) -> list[str]:
    """The items of a comma-separated list of ``[LABEL=]KIND:key=value`` specs, empty ones dropped. A comma ends an
    item only where a name follows (the next spec, or its label): a value may hold one (Mirror-SD's ``threads=2,1``)."""
    return [item.strip() for item in re.split(r",(?=\s*(?:[A-Za-z_]|[\w.\-]+=|,|$))", text) if item.strip()]


#: The method every other one equals token for token, and the one a plan falls back to.
REFERENCE = "ar"


def default_method(draft: object | None) -> str:
    """``sd`` when a draft is given, else the reference (like vLLM and llama.cpp: speculative only when
    configured)."""
    return REFERENCE if draft is None else "sd"
