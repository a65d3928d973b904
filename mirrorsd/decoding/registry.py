"""The method registry: every decoding method registers its name, whether it needs a draft, a typed options
dataclass (defaults, help, validation) and how to build its roles, once. The API validates through it, the
CLI builds ``--method`` choices and per-method flags from it, ``mirrorsd bench`` parses ``KIND:key=value``
with it, the planner asks it for each method's cost model, and ``mirrorsd methods`` lists it.

A new method is one new module that calls :func:`register` (see ``tests/test_registry.py``'s example).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ..errors import OptionError
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

    @property
    def shown_default(self) -> str:
        return self.default_text or str(self.default)

    def convert(self, value: Any) -> Any:
        """A Python value, parsing strings for non-string options and checking it."""
        if isinstance(value, str) and self.parse is not str:
            try:
                value = self.parse(value)
            except ValueError:
                kind = {int: "an integer", float: "a number"}.get(self.parse) or getattr(self.parse, "kind", "valid")
                raise OptionError(self.name, f"must be {kind}, got {value!r}") from None
        if value is None:
            return value
        if self.choices is not None and value not in self.choices:
            raise OptionError(self.name, f"must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.check is not None and not self.check[0](value):
            raise OptionError(self.name, f"{self.check[1]}, got {value!r}")
        return value


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None,
           choices: Sequence[Any] | None = None, check: tuple[Callable[[Any], bool], str] | None = None,
           flag: str | None = None, metavar: str | None = None, const: Any = None,
           default_text: str | None = None) -> Any:
    """A dataclass field carrying its :class:`Option` description (``parse`` defaults to the default's type)."""
    meta = {"help": help, "parse": parse or type(default), "choices": tuple(choices) if choices else None,
            "check": check, "flag": flag, "metavar": metavar, "const": const, "default_text": default_text}
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
    def parse(cls, values: Mapping[str, Any], method: str, shape: ModelShape | None = None) -> MethodOptions:
        """Options from ``values`` (strings are parsed); None means the default. Unknown names are refused."""
        fields = {o.name: o for o in cls.fields()}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            known = ", ".join(fields) or "none"
            raise OptionError(unknown[0], f"is not an option of method {method!r} (its options: {known})")
        given = {k: fields[k].convert(v) for k, v in values.items() if v is not None}
        opts = cls(**given)
        opts.check(shape)
        return opts

    def check(self, shape: ModelShape | None) -> None:
        """Checks across options or against the target's shape (None: not known yet)."""

    def to_dict(self) -> dict[str, Any]:
        return {o.name: getattr(self, o.name) for o in self.fields()}


# -- methods --------------------------------------------------------------------------------------------------


class CostTable(Protocol):
    """What the planner measured (:class:`mirrorsd.bench.plan.Costs`), as a method's cost model reads it."""

    def target(self, rows: float) -> float: ...  # ms of a target forward over ``rows`` tokens

    def draft(self, rows: float, vocab: int | None = 0) -> float: ...  # draft_vocab as the option gives it

    def prefix(self, exit_layer: int, rows: float) -> float: ...  # target layers [0, ℓe)

    def exit_head(self, rows: float) -> float: ...

    def for_backend(self, backend: str) -> CostTable: ...


StepCost = Callable[[CostTable, Mapping[str, Any], Any], float]  # (costs, one recorded step, options) -> ms


@dataclass(frozen=True)
class Method:
    """A registered decoding method.

    ``build(request, options)`` returns the engine roles for one request. ``step_cost`` is the planner's cost
    model: milliseconds of one recorded step (a dict from ``GenerationStats.step_log``). ``rejection`` says
    whether the method supports ``acceptance="rejection"`` (the conformance suite tests its distribution);
    ``bridged`` whether it takes a draft with a tokenizer of its own (:mod:`mirrorsd.decoding.bridge`).
    """

    name: str
    summary: str
    needs_draft: bool
    options: type[MethodOptions]
    build: Callable[[Any, Any], Roles]
    step_cost: StepCost | None = None
    rejection: bool = False
    bridged: bool = False

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
             build: Callable[[Any, Any], Roles], step_cost: StepCost | None = None,
             rejection: bool = False, bridged: bool = False) -> Method:
    return Registry.add(Method(name, summary, needs_draft, options, build, step_cost, rejection, bridged))


def methods() -> list[Method]:
    return Registry.all()


def get_method(name: str) -> Method:
    return Registry.get(name)
