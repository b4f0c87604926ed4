"""The `deepinfer` command line, run in-process through `main(argv)` and once as the installed script."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from deepinfer.serve.cli import EnvDefaults, build_parser, main

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 129280
# `   1   13326  0.0003  'ju'`: rank, id, probability, repr of the decoded token
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d\.\d{4})\s+(['\"].*['\"])$")


def ranked_rows(out: str) -> list[tuple[int, int, float, str]]:
    return [(int(m[1]), int(m[2]), float(m[3]), m[4]) for m in map(ROW.match, out.splitlines()) if m]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err


# ---- help and config -----------------------------------------------------------------------


def test_help_lists_subcommands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in ("config", "forward", "convert"):
        assert re.search(rf"^\s+{name}\s", out, re.M), out


def test_no_arguments_prints_help_and_exits_2(capsys):
    code, out, err = run(capsys)
    assert code == 2
    assert "usage: deepinfer" in err and "forward" in err
    assert out == ""


def test_group_without_action_exits_2(capsys):
    code, _, err = run(capsys, "config")
    assert code == 2
    assert "show" in err


def test_config_show_json(capsys):
    code, out, _ = run(capsys, "config", "show", "tiny-v4.1", "--json")
    assert code == 0
    config = json.loads(out)
    assert config["name"] == "tiny-v4.1"
    assert config["hidden_size"] == 128
    assert config["num_hidden_layers"] == 10
    assert config["vocab_size"] == VOCAB
    assert config["bos_token_id"] == 0
    assert config["dtype"] == "float32"
    assert isinstance(config["compress_ratios"], list)


def test_config_show_text(capsys):
    code, out, _ = run(capsys, "config", "show", "deepseek-v4.1-flash")
    assert code == 0
    values = {}
    for line in out.splitlines():
        if line.startswith("#"):
            continue
        key, sep, value = line.partition(":")
        assert sep, line
        values[key] = value.strip()
    assert values["name"] == "deepseek-v4.1-flash"
    assert values["vocab_size"] == "129280"
    assert values["num_hidden_layers"] == "40"
    assert values["kv_source_layer_ids"] == "[2, 8, 14, 20]"
    assert values["global_cache_bytes_per_token"] == "890"
    # values start in one column
    columns = {len(line) - len(line.split(":", 1)[1].lstrip()) for line in out.splitlines()
               if not line.startswith("#")}
    assert len(columns) == 1


def test_config_show_reads_a_checkpoint_config(capsys, tmp_path):
    code, out, _ = run(capsys, "config", "show", "tiny-v4.1", "--json")
    assert code == 0
    from deepinfer.model import load_config
    from deepinfer.model.config import to_hf_config

    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(load_config("tiny-v4.1"))))
    code, out2, _ = run(capsys, "config", "show", str(tmp_path), "--json")
    assert code == 0
    a, b = json.loads(out), json.loads(out2)
    assert b["hidden_size"] == a["hidden_size"] and b["compress_ratios"] == a["compress_ratios"]


# ---- forward -------------------------------------------------------------------------------


def test_forward_tiny_preset(capsys):
    code, out, err = run(capsys, "forward", "--preset", "tiny-v4.1", "--prompt", "Hello")
    assert code == 0, err
    assert "random weights (seed 0)" in out
    assert "dtype float32" in out
    assert re.search(r"tokenize [\d.]+ m?s", out) and re.search(r"compile\+run [\d.]+ m?s", out)
    rows = ranked_rows(out)
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5]
    probs = [r[2] for r in rows]
    assert all(0 < p <= 1 for p in probs), probs
    assert probs == sorted(probs, reverse=True)
    assert all(0 <= r[1] < VOCAB for r in rows)
    assert len({r[1] for r in rows}) == 5
    from deepinfer.model.tokenizer import decode_token, load_tokenizer

    tokenizer = load_tokenizer()
    for _, token_id, _, text in rows:
        assert text == repr(decode_token(tokenizer, token_id))


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["forward", "--preset", "no-such-model", "--prompt", "Hello"], ["no-such-model", "tiny-v4.1"]),
        (["forward", "--preset", "tiny-v4.1", "--prompt", ""], ["empty prompt"]),
        (["forward", "--preset", "tiny-v4.1", "--prompt", "x", "--top", "0"], ["--top"]),
        (["forward", "--checkpoint", "/no/such/dir", "--prompt", "x"], ["/no/such/dir"]),
        (["forward", "--preset", "tiny-v4.1"], ["--prompt"]),
        (["forward", "--prompt", "x"], ["--preset", "--checkpoint"]),
        (["forward", "--preset", "tiny-v4.1", "--prompt", "x", "--dtype", "float16"], ["float16"]),
        (["config", "show", "no-such-model"], ["no-such-model"]),
        (["convert", "/no/such/src", "/tmp/whatever"], ["/no/such/src"]),
        (["frobnicate"], ["frobnicate"]),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, needles):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert_one_line_error(err, *needles)


def test_forward_refuses_random_weights_that_do_not_fit(capsys, monkeypatch):
    import deepinfer.serve.cli as cli

    monkeypatch.setattr(cli, "_available_memory_bytes", lambda: 2**30)
    code, _, err = run(capsys, "forward", "--preset", "deepseek-v4.1-flash", "--prompt", "Hi")
    assert code == 2
    assert_one_line_error(err, "deepseek-v4.1-flash", "GiB")


# ---- convert and forward from a checkpoint ---------------------------------------------------


@pytest.mark.slow
def test_convert_then_forward_from_checkpoint(capsys, tmp_path):
    from deepinfer.model import init_params, load_config, write_checkpoint

    config = load_config("tiny-v4.1")
    src, dst = tmp_path / "official", tmp_path / "orbax"
    write_checkpoint(init_params(config, 0), config, src)

    code, out, err = run(capsys, "convert", str(src), str(dst))
    assert code == 0, err
    assert str(dst) in out and "wrote" in out
    assert any(dst.iterdir())

    code, _, err = run(capsys, "convert", str(src), str(dst))  # refuses to overwrite
    assert code == 2
    assert_one_line_error(err, "--overwrite")

    code, out, err = run(capsys, "forward", "--checkpoint", str(dst), "--prompt", "Hello", "--top", "3",
                         "--dtype", "float32")
    assert code == 0, err
    assert f"checkpoint {dst}" in out
    rows = ranked_rows(out)
    assert [r[0] for r in rows] == [1, 2, 3]
    assert all(0 < r[2] <= 1 for r in rows)


# ---- environment and packaging ---------------------------------------------------------------


def test_environment_is_read_only_through_env_defaults():
    env = EnvDefaults.from_environ({"DEEPINFER_COMPILATION_CACHE": "/tmp/jaxcache", "OTHER": "x"})
    args = build_parser(env).parse_args(["forward", "--preset", "tiny-v4.1", "--prompt", "x"])
    assert args.compilation_cache == "/tmp/jaxcache"
    args = build_parser(EnvDefaults.from_environ({})).parse_args(["forward", "--preset", "tiny-v4.1", "--prompt", "x"])
    assert args.compilation_cache is None


def test_no_other_module_reads_deepinfer_environment_variables():
    """DEEPINFER_* variables are read only by the command line (serve/cli.py)."""
    offenders = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "build", "__pycache__")]
        for name in files:
            rel = (pathlib.Path(root) / name).relative_to(REPO)
            if name.endswith(".py") and rel.as_posix() != "serve/cli.py":
                if "DEEPINFER_" in (REPO / rel).read_text(encoding="utf-8", errors="replace"):
                    offenders.append(rel.as_posix())
    assert offenders == [], f"modules mentioning DEEPINFER_* outside serve/cli.py: {offenders}"


def test_cli_import_does_not_import_jax():
    code = "import sys, deepinfer.serve.cli; sys.exit(1 if 'jax' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_installed_console_script_help():
    script = os.path.join(os.path.dirname(sys.executable), "deepinfer")
    assert os.path.isfile(script), f"console script not installed at {script} (pip install -e .)"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("config", "forward", "convert"):
        assert name in result.stdout
