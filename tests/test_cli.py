"""The `deepinfer` command line, run in-process through `main(argv)` and once as the installed script."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from deepinfer.serve.cli import CliError, EnvDefaults, build_parser, main

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

    monkeypatch.setattr(cli, "_available_memory_bytes", lambda device: 2**30)
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


def test_environment_is_read_only_through_env_defaults(tmp_path, monkeypatch):
    from deepinfer.serve.engine_args import compilation_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    env = EnvDefaults.from_environ({"DEEPINFER_COMPILATION_CACHE": "/tmp/jaxcache", "OTHER": "x"})
    args = build_parser(env).parse_args(["forward", "--preset", "tiny-v4.1", "--prompt", "x"])
    assert args.compilation_cache == "/tmp/jaxcache" and compilation_cache_dir(args) == "/tmp/jaxcache"
    for command in (["forward", "--preset", "tiny-v4.1", "--prompt", "x"], ["generate", "--prompt", "x"],
                    ["run-batch", "-i", "a", "-o", "b"], ["serve"]):
        args = build_parser(EnvDefaults.from_environ({})).parse_args(command)
        assert args.compilation_cache is None  # on by default, under the home directory
        assert compilation_cache_dir(args) == str(tmp_path / ".cache" / "deepinfer" / "xla")
        assert compilation_cache_dir(build_parser(env).parse_args([*command, "--no-compilation-cache"])) is None
    (tmp_path / "file").write_text("")
    args = build_parser(env).parse_args(["generate", "--prompt", "x", "--compilation-cache", str(tmp_path / "file")])
    with pytest.raises(CliError, match="--compilation-cache: .* is not a directory"):
        compilation_cache_dir(args)


def test_no_other_module_reads_deepinfer_environment_variables():
    """DEEPINFER_* variables are read only by the command line (serve/cli.py and the engine options
    it shares with `serve`, serve/engine_args.py)."""
    offenders = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "build", "__pycache__")]
        for name in files:
            rel = (pathlib.Path(root) / name).relative_to(REPO)
            if name.endswith(".py") and rel.as_posix() not in ("serve/cli.py", "serve/engine_args.py"):
                if "DEEPINFER_" in (REPO / rel).read_text(encoding="utf-8", errors="replace"):
                    offenders.append(rel.as_posix())
    assert offenders == [], f"modules mentioning DEEPINFER_* outside the command line: {offenders}"


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


# ---- generate and run-batch (the offline engine) ------------------------------------------------

# a small cache budget keeps the compiled step shapes few (the same as tests/serve/test_llm.py)
SMALL_ENGINE = ["--max-num-seqs", "4", "--max-model-len", "512", "--page-size", "64", "--prefill-chunk", "128"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home directory: the embedded default checkpoint is written under it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
                 "DEEPINFER_COMPILATION_CACHE", "DEEPINFER_ACCELERATOR"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_help_lists_the_engine_subcommands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in ("generate", "run-batch"):
        assert re.search(rf"^\s+{name}\s", out, re.M), out


@pytest.mark.slow
def test_generate_prompts_and_chat_with_the_embedded_default(capsys, home, monkeypatch):
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "full")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "150")
    code, out, err = run(capsys, "generate", "--prompt", "The capital of France is", "Hello",
                         "--max-tokens", "3", "--temperature", "0", *SMALL_ENGINE)
    assert code == 0, err
    from deepinfer.serve.api.embedded import trained_weights

    checkpoint = home / ".cache" / "deepinfer" / f"tiny-v4.1-trained-{trained_weights()['sha256'][:12]}"
    assert (checkpoint / "config.json").is_file()
    assert f"tiny-v4.1-trained (embedded, trained on the Python standard library; checkpoint {checkpoint})" in out
    assert "prefill full (keep 150)" in out  # the environment's defaults reached the engine
    assert "--- prompt 0: 'The capital of France is' (6 tokens)" in out
    assert "--- prompt 1: 'Hello' (2 tokens)" in out
    assert out.count("--- 3 tokens, finish_reason=length") == 2
    assert re.search(r"^speed\s+: 8 prompt \+ 6 generated tokens in .* generated tokens/s", out, re.M), out
    assert re.search(r"^compile\s+: \d+ step shapes in .* before the first step \(persistent cache: ", out, re.M), out

    # options win over the environment; --chat prints the content (and reasoning in thinking mode)
    # (and --choice constrains the answer to one of the choices, here jumping forward)
    code, out, err = run(capsys, "generate", "--chat", "Hi", "--max-tokens", "8", "--temperature", "0",
                         "--prefill-mode", "compact", "--keep-tokens", "140", "--choice", "yes", "no",
                         "--jump-forward", *SMALL_ENGINE)
    assert code == 0, err
    assert "prefill compact (keep 140)" in out
    assert "--- chat: 'Hi'" in out and "thinking off" in out
    assert "--- content:" in out and "--- reasoning:" not in out
    assert re.search(r"^--- content:\n(yes|no)\n--- \d+ tokens, finish_reason=stop$", out, re.M), out


def test_generate_summarises_speculative_decoding():
    """`generate` with --speculative-config prints what was verified and accepted and, with
    confidence-scheduled verification, the step-cost curve in the form that pins it next time."""
    from deepinfer.serve.cli import speculation_lines
    from deepinfer.serve.engine.speculative import SpecDecodeCounts, SpeculativeConfig

    counts = SpecDecodeCounts(2)
    for drafts, accepted in ((2, 1), (2, 2), (1, 0)):
        counts.record(drafts, accepted)
    assert speculation_lines(SpeculativeConfig(num_speculative_tokens=2), counts, None) == [
        "dspark  : 2 drafts per verify step: 3 verify rows accepted 3 of 5 drafts, mean acceptance length 2.00"]
    before = counts.snapshot()
    counts.record(2, 2)
    recent = counts.since(before)  # (the interval of a periodic log line)
    assert (recent.num_drafts, recent.num_draft_tokens, recent.num_accepted_tokens, recent.accepted_per_pos,
            recent.mean_acceptance_length) == (1, 2, 2, [1, 1], 3.0)
    assert before.accepted_per_pos == [2, 1]  # (a copy, not the live counters)
    adaptive = SpeculativeConfig(num_speculative_tokens=2, enable_adaptive_verification=True)
    first, costs = speculation_lines(adaptive, SpecDecodeCounts(2), [0.0125, 0.025, 0.03])
    assert first == "dspark  : at most 2 drafts per verify step, confidence-scheduled: no drafts verified"
    assert costs == ('costs   : plain decode 12.5 ms, verify by drafts per row 25.0 / 30.0 ms (reuse with '
                     '--speculative-config "verify_step_seconds": [0.012500, 0.025000, 0.030000])')
    pinned = json.loads(costs.split('"verify_step_seconds": ')[1][:-1])
    assert SpeculativeConfig.from_value({"num_speculative_tokens": 2, "enable_adaptive_verification": True,
                                         "verify_step_seconds": pinned}).verify_step_seconds == (0.0125, 0.025, 0.03)


@pytest.mark.parametrize(
    ("argv", "env", "needles"),
    [
        (["generate"], {}, ["--prompt", "--chat"]),
        (["generate", "--prompt", "x", "--chat", "y"], {}, ["not allowed"]),
        (["generate", "--prompt", "x", "--max-tokens", "0"], {}, ["--max-tokens"]),
        (["generate", "--prompt", "x", "--keep-tokens", "10"], {}, ["keep_tokens", "sliding window"]),
        (["generate", "--prompt", "x", "--prefill-mode", "sparse"], {}, ["sparse"]),
        (["generate", "--prompt", "x"], {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "sparse"},
         ["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "sparse"]),
        (["generate", "--prompt", "x"], {"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "many"},
         ["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "many"]),
        (["generate", "--prompt", "x", "--model", "deepseek-v4.1-flash"], {}, ["deepseek-v4.1-flash", "no weights"]),
        (["generate", "--prompt", "x", "--model", "/no/such/dir"], {}, ["/no/such/dir"]),
        (["generate", "--prompt", "x", "--prefill-chunk", "100"], {}, ["--prefill-chunk", "128"]),
        (["generate", "--prompt", "x", "--max-num-batched-tokens", "100"], {}, ["max_num_batched_tokens", "135"]),
        (["generate", "--prompt", "x", "--min-page-bucket-tokens", "0"], {}, ["--min-page-bucket-tokens"]),
        (["run-batch", "-i", "/no/such/in.jsonl", "-o", "/tmp/out.jsonl"], {}, ["/no/such/in.jsonl"]),
        (["generate", "--prompt", "x", "--regex", "a", "--choice", "b"], {}, ["at most one of"]),
        (["generate", "--prompt", "x", "--json-schema", "/no/such/schema.json"], {},
         ["--json-schema", "/no/such/schema.json"]),
        (["generate", "--prompt", "x", "--choice", ""], {}, ["--choice"]),
        (["generate", "--prompt", "x", "--jump-forward"], {}, ["--jump-forward", "needs a structured-output"]),
        (["generate", "--prompt", "x", "--logprobs", "2"], {}, ["--logprobs", "--json"]),
        (["generate", "--prompt", "x", "--json", "--logprobs", "-1"], {}, ["--logprobs", "non-negative"]),
        (["generate", "--prompt", "x", "--regex", "[0-9", *SMALL_ENGINE], {}, ["structured_outputs.regex", "[0-9"]),
    ],
)
def test_engine_commands_reject_bad_input_with_one_line(capsys, home, monkeypatch, argv, env, needles):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert_one_line_error(err, *needles)


def test_yoco_environment_variables_are_read_through_env_defaults():
    env = EnvDefaults.from_environ({"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "full",
                                    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "200"})
    assert (env.resolved_prefill_mode(), env.resolved_keep_tokens()) == ("full", 200)
    env = EnvDefaults.from_environ({})
    assert (env.resolved_prefill_mode(), env.resolved_keep_tokens()) == ("compact", 140)


@pytest.mark.slow
def test_run_batch_writes_one_line_per_input_line(capsys, home, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hello", "max_tokens": 2, "temperature": 0}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    code, out, err = run(capsys, "run-batch", "-i", str(src), "-o", str(dst), "--prefill-mode", "full",
                         *SMALL_ENGINE)
    assert code == 0, err
    assert f"wrote 3 result lines to {dst} (2 succeeded, 1 failed)" in out
    results = [json.loads(r) for r in dst.read_text(encoding="utf-8").splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "b", "c"]
    assert [r["response"]["status_code"] for r in results] == [200, 400, 200]
    assert "stream" in results[1]["error"]["message"]
    assert results[0]["response"]["body"]["usage"]["completion_tokens"] == 2


@pytest.fixture
def fake_batch(monkeypatch):
    """run-batch without an engine: records what `run_batch` got; set `failed` to choose its result."""
    import deepinfer.serve.api.batch as batch
    from deepinfer.serve import cli

    state = {"failed": 0, "calls": []}

    def run_batch(llm, input_path, output_path, *, prometheus_port=None, previous=None):
        state["calls"].append({"input": input_path, "output": output_path, "previous": previous})
        return batch.BatchSummary(total=3, succeeded=3 - state["failed"], failed=state["failed"], skipped=1)

    monkeypatch.setattr(cli, "_make_llm", lambda args, **kwargs: object())
    monkeypatch.setattr(batch, "run_batch", run_batch)
    return state


@pytest.mark.parametrize(("failed", "flags", "code"), [(1, [], 0), (1, ["--fail-on-error"], 3),
                                                        (0, ["--fail-on-error"], 0)])
def test_run_batch_exit_code_with_failed_lines(capsys, tmp_path, fake_batch, failed, flags, code):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("{}\n")
    fake_batch["failed"] = failed
    got, out, err = run(capsys, "run-batch", "-i", str(src), "-o", str(dst), *flags)
    assert got == code, err
    assert f"wrote 3 result lines to {dst} ({3 - failed} succeeded, {failed} failed) in" in out
    assert fake_batch["calls"][0]["previous"] is None


def test_run_batch_resume_passes_the_earlier_results(capsys, tmp_path, fake_batch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("{}\n")
    done = {"id": "x", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    dst.write_text(json.dumps(done) + "\n" + json.dumps(done)[:20])  # the last line was cut short
    code, out, err = run(capsys, "run-batch", "-i", str(src), "-o", str(dst), "--resume")
    assert code == 0, err
    previous = fake_batch["calls"][0]["previous"]
    assert previous.done_ids == {"a"} and previous.dropped == 1
    assert "(3 succeeded, 0 failed; 1 already done)" in out


def test_run_batch_resume_rejects_what_it_cannot_resume(capsys, tmp_path, fake_batch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("{}\n")
    code, _, err = run(capsys, "run-batch", "-i", str(src), "-o", "-", "--resume")
    assert code == 2
    assert_one_line_error(err, "--resume", "output file")
    dst.write_text("not a result\n{}\n")
    code, _, err = run(capsys, "run-batch", "-i", str(src), "-o", str(dst), "--resume")
    assert code == 2
    assert_one_line_error(err, "--resume", str(dst), "line 1")
    assert not fake_batch["calls"] and dst.read_text() == "not a result\n{}\n"


def test_run_batch_help_documents_exit_codes_and_options(capsys):
    code, out, _ = run(capsys, "run-batch", "--help")
    assert code == 0
    flat = " ".join(out.split())
    for needle in ("--resume", "--fail-on-error", "exit codes: 0 the run completed", "3 with --fail-on-error"):
        assert needle in flat, needle


def test_cli_prefill_modes_are_the_engine_s():
    from deepinfer.serve import engine_args
    from deepinfer.serve.engine.engine import PREFILL_MODES

    assert engine_args.PREFILL_MODES == PREFILL_MODES


def test_speculative_config_option_is_checked_by_name():
    from deepinfer.serve.engine_args import engine_settings

    def settings(text):
        args = build_parser(EnvDefaults()).parse_args(["generate", "--prompt", "x", "--no-compilation-cache",
                                                       "--speculative-config", text])
        return engine_settings(args)["speculative_config"]

    assert settings('{"method": "dspark", "num_speculative_tokens": 3}') == {"method": "dspark",
                                                                             "num_speculative_tokens": 3}
    with pytest.raises(CliError, match="--speculative-config: not JSON"):
        settings("{method: dspark}")
    with pytest.raises(CliError, match=r"--speculative-config\.k: unknown key"):
        settings('{"k": 3}')
    assert settings('{"enable_adaptive_verification": true}') == {"enable_adaptive_verification": True}
    with pytest.raises(CliError, match="enable_adaptive_verification must be true or false"):
        settings('{"enable_adaptive_verification": 1}')
    with pytest.raises(CliError, match="num_speculative_tokens must be a positive integer"):
        settings('{"num_speculative_tokens": 0}')
    assert engine_settings(build_parser(EnvDefaults()).parse_args(
        ["generate", "--prompt", "x", "--no-compilation-cache"]))["speculative_config"] is None


def test_min_page_bucket_tokens_option_reaches_the_llm_arguments():
    from deepinfer.serve.engine_args import engine_settings

    def settings(*extra):
        return engine_settings(build_parser(EnvDefaults()).parse_args(
            ["generate", "--prompt", "x", "--no-compilation-cache", *extra]))

    assert settings()["min_page_bucket_tokens"] == 2048  # EngineConfig's default
    assert settings("--min-page-bucket-tokens", "256")["min_page_bucket_tokens"] == 256
