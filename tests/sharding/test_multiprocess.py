"""Many hosts: two processes with four CPU devices each join through `jax.distributed`
(`deepinfer generate --coordinator/--num-processes/--process-id`) and generate exactly the tokens
of a one-process run; only process 0 prints.

Each process is a real `deepinfer generate` subprocess on 127.0.0.1 (gloo collectives)."""

import json
import os
import socket
import subprocess
import sys

import pytest

PROMPTS = ["The capital of France is", "Once upon a time"]
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(checkpoint: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deepinfer.serve.cli", "generate", "--model", checkpoint, "--json",
            "--temperature", "0", "--max-tokens", "6", "--max-model-len", "256", "--max-num-seqs", "8",
            "--prompt", *PROMPTS, *extra]


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
    assert _outputs(results[0][1]) == expected
    assert results[1][1] == ""  # only process 0 prints
