"""Dependencies point down: no module imports one from a higher layer (function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import mirrorsd

PACKAGE = Path(mirrorsd.__file__).parent

# Bottom to top. A module may import its own layer and the ones below it.
LAYERS = [
    {"errors", "cache", "files", "collector", "kept", "transfer", "quant", "sampling", "kv_cache", "prefix_cache",
     "kernels", "linear", "gguf_weights", "model",
     "loading", "weight_cache", "execution", "cuda_graphs", "verify", "runtime", "draft_vocab",
     "exit_heads", "tuned_drafts"},  # the model, kernels, executors
    {"decoding"},  # the loop, the roles, the methods and their registry
    {"zoo", "plans", "specbench", "api", "batching"},  # loading models, the HF-like API, continuous batching
    {"perplexity", "quality", "training", "train_streams", "train_draft", "train_eagle", "train_exit", "vocab_tables",
     "distill"},  # tools
    {"bench"},  # benchmarks and the planner
    {"server"},  # mirrorsd serve: the OpenAI-compatible HTTP server
    {"cli", "__init__", "__main__"},  # the command line and the package's public names
]


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"mirrorsd.{module} is in no layer of tests/test_layers.py; add it where it belongs")


def _is_module(name: str) -> bool:
    return (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name / "__init__.py").is_file()


def imports(source: str, package: list[str]) -> list[tuple[int, str]]:
    """(line, module relative to mirrorsd) of every mirrorsd import in ``source``, a module of the subpackage
    ``package`` (``[]`` for top-level modules)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                names = [*base, *(node.module.split(".") if node.module else [])]
                if node.module:
                    out.append((node.lineno, ".".join(names)))
                else:  # from . import x, y
                    out.extend((node.lineno, ".".join([*names, a.name])) for a in node.names)
            elif node.module and node.module.split(".")[0] == "mirrorsd":
                rest = node.module.split(".")[1:]
                if rest:
                    out.append((node.lineno, ".".join(rest)))
                else:  # from mirrorsd import api / generate: a submodule, else the package's own names
                    out.extend((node.lineno, a.name if _is_module(a.name) else "__init__") for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name.split(".", 1)[1] if "." in a.name else "__init__") for a in node.names
                       if a.name.split(".")[0] == "mirrorsd")
    return out


def test_no_module_imports_an_upper_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for line, module in imports(path.read_text(encoding="utf-8"), list(path.relative_to(PACKAGE).parts[:-1])):
            if module and layer_of(module) > layer_of(own):
                upward.append(f"mirrorsd/{path.relative_to(PACKAGE)}:{line} imports mirrorsd.{module}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


SHARED = ("engine", "registry", "drafting", "draft_graph", "proposers", "bridge", "streams", "lookup", "suffix_index")
METHODS = ("ar", "sd", "suffix", "ss", "mirror", "eagle")  # a module or a package each


def test_no_decoding_module_imports_another_method():
    """What several methods share lives outside the methods' modules: the core importing ``ss`` (for its adapters and
    passes) made one method's package everyone's dependency, and ``sd``, ``ss`` and ``mirror`` took the suffix
    hybrid from method ``suffix``'s module. The shared core imports no method; a method imports only itself."""
    found = []
    decoding = PACKAGE / "decoding"
    for path in sorted(decoding.rglob("*.py")):
        parts = path.relative_to(decoding).with_suffix("").parts
        own = parts[0] if parts[0] in METHODS else None
        assert own or parts[0] in SHARED or parts[0] == "__init__", f"decoding/{'/'.join(parts)} is in no group"
        if parts[0] == "__init__":
            continue  # the package registers every method
        for line, module in imports(path.read_text(encoding="utf-8"), ["decoding", *parts[:-1]]):
            names = module.split(".")
            if names[0] == "decoding" and len(names) > 1 and names[1] in METHODS and names[1] != own:
                found.append(f"mirrorsd/decoding/{'/'.join(parts)}.py:{line} imports mirrorsd.{module}")
    assert not found, "\n".join(found)


def test_the_checker_sees_upward_imports_in_functions_too():
    source = "import torch\n\ndef f():\n    from ..api import generate\n    from mirrorsd.bench import plan\n"
    found = imports(source, ["decoding"])
    assert found == [(4, "api"), (5, "bench")]
    assert all(layer_of(m) > layer_of("decoding") for _, m in found)


def test_the_checker_sees_the_package_itself():
    """``import mirrorsd`` and ``from mirrorsd import generate`` import the package's ``__init__`` (the top layer,
    which imports the API and the planner): a lower module doing so is an upward import."""
    source = "def f():\n    import mirrorsd\n    from mirrorsd import generate, api\n    from .. import zoo\n"
    assert imports(source, ["bench"]) == [(2, "__init__"), (3, "__init__"), (3, "api"), (4, "zoo")]
    assert layer_of("__init__") > layer_of("bench")
