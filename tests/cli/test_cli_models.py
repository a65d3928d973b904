"""``mirrorsd models`` output and cache errors, ``mirrorsd --version``: fast, no model weights needed."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

from mirrorsd import cli, zoo
from tests.helpers import requires_smollm2


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------- cache errors


@pytest.mark.parametrize("argv", [["models", "list"], ["models", "prepare", "smollm2-135m"]])
def test_cache_that_is_a_file_is_a_one_line_error(argv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("MIRRORSD_CACHE", str(blocker))
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = _lines(captured.err)
    assert len(err) == 1, captured.err
    assert err[0].startswith("mirrorsd: error: ")
    assert f"MIRRORSD_CACHE={blocker} is a file, not a folder" in err[0]
    assert "Traceback" not in captured.err


def test_default_cache_that_is_a_file_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIRRORSD_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "mirrorsd").write_text("x")
    with pytest.raises(zoo.CacheDirError, match=r"cache folder .*mirrorsd is a file.*set MIRRORSD_CACHE"):
        zoo.cache_dir()
    assert issubclass(zoo.CacheDirError, ValueError)


def test_cache_under_a_file_cannot_be_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(zoo, "_locate", lambda entry: [])  # as if the weight packages were installed
    assert cli.main(["models", "prepare", "smollm2-135m"]) == 2
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and f"MIRRORSD_CACHE={tmp_path / 'file' / 'cache'} cannot be used" in err[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0o500")
def test_unwritable_cache_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    cache = parent / "cache"
    monkeypatch.setenv("MIRRORSD_CACHE", str(cache))
    monkeypatch.setattr(zoo, "_locate", lambda entry: [])
    parent.chmod(0o500)
    try:
        assert cli.main(["models", "list"]) == 0  # listing only reads: a missing cache is fine
        capsys.readouterr()
        assert cli.main(["models", "prepare", "smollm2-135m"]) == 2
        err = _lines(capsys.readouterr().err)
        assert len(err) == 1 and f"MIRRORSD_CACHE={cache} cannot be used" in err[0]
        assert "writable folder" in err[0]
        assert not cache.exists()
    finally:
        parent.chmod(0o700)


def test_permission_denied_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """What an unwritable parent gives a non-root user, simulated so that it also runs as root."""
    cache = tmp_path / "locked" / "cache"
    monkeypatch.setenv("MIRRORSD_CACHE", str(cache))
    monkeypatch.setattr(zoo, "_locate", lambda entry: [])

    def denied(self: Path, *args, **kwargs) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    assert cli.main(["models", "prepare", "smollm2-135m"]) == 2
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1
    assert f"MIRRORSD_CACHE={cache} cannot be used: {cache} cannot be created (Permission denied: " in err[0]


def test_existing_unwritable_cache_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes through chmod 0o500")
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MIRRORSD_CACHE", str(cache))
    cache.chmod(0o500)
    try:
        with pytest.raises(zoo.CacheDirError, match="is not writable"):
            zoo.ensure_cache_dir()
    finally:
        cache.chmod(0o700)


def test_existing_unwritable_cache_is_refused_for_root_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above skips as root (root writes through chmod): the same refusal, with access denied simulated."""
    from mirrorsd import cache as cache_module

    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv("MIRRORSD_CACHE", str(folder))
    monkeypatch.setattr(cache_module.os, "access", lambda path, mode: Path(path) != folder)
    with pytest.raises(zoo.CacheDirError, match="is not writable"):
        zoo.ensure_cache_dir()


def test_ensure_cache_dir_creates_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "c"))
    assert zoo.ensure_cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    from mirrorsd.cache import ensure_cache_dir

    assert ensure_cache_dir(tmp_path / "c" / "kernels" / "k").is_dir()


# ------------------------------------------------------------------------------------- models list


def _typed_by_users() -> list[str]:
    return [name for name in zoo.ZOO] + [entry.pip_command for entry in zoo.ZOO.values()]


def test_models_list_piped_prints_plain_untruncated_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys) -> None:
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("COLUMNS", "80")
    for var in ("TTY_COMPATIBLE", "FORCE_COLOR"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["name", "default", "format", "installed", "prepared", "install", "with"]
    assert "\x1b[" not in out and "…" not in out
    for name, entry in zoo.ZOO.items():
        row = next(line for line in lines if line.startswith(name + " "))
        assert row.endswith("  " + entry.pip_command)
        assert entry.default_weights in row


@pytest.mark.parametrize("columns", [40, 60, 80, 100, 200])
def test_models_list_terminal_never_cuts_names(columns: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys) -> None:
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: treat the captured stdout as a terminal
    monkeypatch.setenv("NO_COLOR", "1")
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    for text in _typed_by_users():
        assert text in out, (columns, text)
    if columns < 80:  # too narrow for the table: the plain rows
        assert "install with:" not in out
        return
    assert "install with:" in out  # the table fits an 80-column terminal, the commands print below it
    table = re.sub(r"\x1b\[[0-9;]*m", "", out.split("install with:")[0])
    assert all(len(line) <= columns for line in table.splitlines())


# ------------------------------------------------------------------------------------- --version


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"mirrorsd {importlib.metadata.version('mirrorsd')}"


def test_version_without_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    import mirrorsd

    assert cli._version() == mirrorsd.__version__


# ------------------------------------------------------------------------------------- models params


def test_models_params_counts_the_shipped_adapters_against_medusa(capsys) -> None:
    """The SS paper's Table 1 counting: stream embeddings γ·h + the pruning adapter 2·r·h, against Medusa's
    heads·(h² + h·v); checked against the paper's own OPT-1.3b figures and against each shipped file's config."""
    import json

    from mirrorsd.decoding.streams.adapters import medusa_parameters

    assert medusa_parameters(2048, 50272, 4) == 428_605_440  # the paper: 4.28E8 for OPT-1.3b
    assert cli.main(["models", "params", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["model"] for r in rows} == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for r in rows:
        config = json.loads((zoo_adapter(r["model"]) / "stream_config.json").read_text())
        assert r["stream_embed"] == config["streams"] * r["hidden"]
        assert r["prune"] == 2 * config["prune_rank"] * r["hidden"]
        lora_per_layer = r["lora"] / config["layers"]
        assert lora_per_layer > 0 and lora_per_layer == int(lora_per_layer)
        assert r["medusa"] == 4 * (r["hidden"] ** 2 + r["hidden"] * r["vocab"])
        assert r["medusa_over_ss"] > 10_000  # the paper's claim: ~10,000x fewer
    assert cli.main(["models", "params"]) == 0
    assert "| qwen2.5-coder-1.5b | 1536 |" in capsys.readouterr().out


def zoo_adapter(name: str) -> Path:
    from mirrorsd.decoding.streams.adapters import shipped_adapter

    folder = shipped_adapter(name)
    assert folder is not None
    return folder


def test_models_prepare_of_a_folder_does_not_suggest_passing_a_folder(tmp_path: Path, capsys) -> None:
    """`models prepare` takes zoo names only: a folder holding config.json was told to pass such a folder."""
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["models", "prepare", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "is not a zoo model" in err and "folder" not in err.split("is not a zoo model")[1]


@requires_smollm2
def test_a_prompt_too_long_further_down_a_prompts_file_stops_the_run_before_the_first_answer(capsys, tmp_path):
    """Every prompt's length is checked once the model is loaded, before the first answer, and the error names the
    line (a 9000-token third prompt ended the run after the first answers, naming no line)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n\n{"prompt": "%s"}\n' % ("word " * 9000))
    rc = cli.main(["generate", "--target", "smollm2-135m", "--method", "ar", "--prompts", str(prompts),
                   "--max-new-tokens", "2", "--json"])
    captured = capsys.readouterr()
    assert rc == 2 and not captured.out.strip()
    assert f"{prompts}:3: the prompt has" in captured.err and "context is 8192" in captured.err


def test_draft_device_with_a_self_draft_is_refused_before_loading(capsys, monkeypatch):
    """A self draft is the target's own first layers, on its device: --draft-device was silently ignored (and under
    --backend devices the error told the user to set the flag they had set)."""
    import mirrorsd

    monkeypatch.setattr(mirrorsd, "load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))
    rc = cli.main(["generate", "--target", "smollm2-135m", "--method", "sd", "--draft", "self:10", "--draft-device",
                   "cuda:3", "--prompt", "hi"])
    assert rc == 2 and "--draft-device does not apply to --draft self:10" in capsys.readouterr().err


@requires_smollm2
def test_the_loaded_format_names_its_float_type_and_what_it_ignored(capsys):
    rc = cli.main(["generate", "--target", "smollm2-135m", "--method", "ar", "--dtype", "bfloat16", "--activations",
                   "int8x2", "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "target smollm2-135m: fp32 weights in bfloat16 (as asked; --activations int8x2 does not apply to fp32" in err


@requires_smollm2
def test_plan_in_bfloat16_on_a_cpu_says_there_is_nothing_to_plan(capsys):
    """Only ar runs exactly there: the planner calibrated suffix and failed on a method the user never named."""
    rc = cli.main(["plan", "--target", "smollm2-135m", "--draft", "none", "--dtype", "bfloat16"])
    assert rc == 2 and "nothing to plan: in bfloat16 on a CPU only ar runs exactly" in capsys.readouterr().err
