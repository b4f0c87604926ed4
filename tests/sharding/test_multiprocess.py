"""Many hosts: two processes with four CPU devices each join through `jax.distributed`
(`deepinfer generate --coordinator/--num-processes/--process-id`) and generate exactly the tokens
of a one-process run; only process 0 prints. With confidence-scheduled DSpark
(`speculative_worker.py`) both processes verify with one step-cost curve, process 0's, and
generate the one-device plain tokens, a grammar-constrained request included (its drafts gathered
from both processes).

Each process is a real subprocess on 127.0.0.1 (gloo collectives)."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from tests.sharding import speculative_worker

PROMPTS = ["The capital of France is", "Once upon a time"]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(checkpoint: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deepinfer.serve.cli", "generate", "--model", checkpoint, "--json",
            "--temperature", "0", "--max-tokens", "6", "--max-model-len", "256", "--max-num-seqs", "8",
            "--logprobs", "1", "--prompt", *PROMPTS, *extra]


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return env


def _outputs(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.multiprocess
def test_two_processes_generate_the_one_process_tokens(checkpoint):
    single = subprocess.run(_command(checkpoint), env=_env(1), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert single.returncode == 0, single.stderr[-2000:]
    expected = _outputs(single.stdout)
    assert len(expected) == len(PROMPTS) and all(len(o["token_ids"]) == 6 for o in expected)
    # --logprobs: each token's {id: [logprob, rank]}, the sampled token (greedy: rank 1) among them
    assert all(str(t) in position and position[str(t)][1] == 1 and len(position) == 1
               for o in expected for t, position in zip(o["token_ids"], o["logprobs"]))

    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(_command(checkpoint, "--mesh", "dp=2,cp=2,tp=2", "--coordinator", address,
                                       "--num-processes", "2", "--process-id", str(i)),
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT_S)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    for i, (code, _, err) in enumerate(results):
        assert code == 0, f"process {i} failed:\n{err[-3000:]}"
    got = _outputs(results[0][1])
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]
    for ours, ref in zip(got, expected):  # (the mesh's sums round otherwise: ~1e-6)
        for mine, theirs in zip(ours["logprobs"], ref["logprobs"]):
            assert mine.keys() == theirs.keys() and all(abs(mine[t][0] - theirs[t][0]) < 1e-4 for t in mine)
    assert results[1][1] == ""  # only process 0 prints


NEAR_TIE = 1e-3  # a greedy choice decided by less (log-probability) may go either way on the mesh


@pytest.mark.multiprocess
def test_two_processes_speculate_with_one_step_cost_curve(checkpoint, tmp_path):
    """Each process has its own verify-step costs (each measures them at start; here they are
    given, and disagree: `speculative_worker.STEP_SECONDS`); unless they agree on one curve they
    choose different verify widths and their collectives never meet. Both must use process 0's;
    the greedy outputs equal one-device plain decoding's (flip-aware: up to a near-tie of the
    reference's top two), the constrained output matches its regex, and drafts were verified."""
    from deepinfer import LLM

    reference = LLM(checkpoint, **speculative_worker.ENGINE)
    prompts, params = zip(*speculative_worker.requests())
    expected = speculative_worker.record(reference.generate(list(prompts), list(params), use_tqdm=False))

    address = f"127.0.0.1:{_free_port()}"
    paths = [tmp_path / f"process{i}.json" for i in range(2)]
    root = pathlib.Path(__file__).resolve().parents[2]
    env = _env(speculative_worker.DEVICES_PER_PROCESS)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sharding.speculative_worker", address, str(i), checkpoint,
                               str(paths[i])], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for i in range(2)]
    try:
        results = [p.communicate(timeout=TIMEOUT_S) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (_, err, code) in enumerate(results):
        assert code == 0, f"process {i} failed:\n{err[-3000:]}"
    seen = [json.loads(path.read_text()) for path in paths]
    assert seen[0]["step_seconds"] == seen[1]["step_seconds"] == speculative_worker.STEP_SECONDS[0]
    assert seen[0] == seen[1]
    got = seen[0]
    assert got["num_drafts"] > 0 and "verify/check+masks" in got["kinds"], got
    for ours, ref in zip(got["outputs"][:2], expected[:2]):
        for i, token in enumerate(ref["token_ids"]):
            if ours["token_ids"][i] != token:
                top = sorted(ref["logprobs"][i].values(), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, f"token {i}: {ours['token_ids'][i]} != {token}"
                break
            for t in set(ours["logprobs"][i]) & set(ref["logprobs"][i]):
                assert abs(ours["logprobs"][i][t] - ref["logprobs"][i][t]) < 1e-4, (i, t)
    constrained = got["outputs"][2]
    assert constrained["finish_reason"] == "stop" and re.fullmatch(speculative_worker.REGEX, constrained["text"]), \
        constrained
