"""Provision and use the Python 3.11 side environment that hosts the torch/transformers oracle.

Runs in the MAIN environment and uses the standard library only. The side environment lives at
``<repo>/.venv-ref`` (git-ignored) and holds torch 2.13.0 (the local CPU wheel, which exists for
CPython 3.11 only), transformers 5.24.0, safetensors and numpy. torch is installed first: if
transformers were installed first, pip would resolve torch itself and pull a multi-GB CUDA build.

    python tests/oracle/sideenv.py            # provision only (what .ci/run can call before pytest)
    python tests/oracle/sideenv.py --check    # exit 0 if ready, 1 otherwise; never installs

Concurrent callers (pytest-xdist workers) serialise on an ``fcntl.flock`` of ``<repo>/.venv-ref.lock``;
a complete environment is recognised by a JSON marker file holding the pinned versions, so the
fast path costs one file read.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH_VERSION = "2.13.0"
TRANSFORMERS_VERSION = "5.24.0"
PY_MAJOR_MINOR = (3, 11)
ENV_DIRNAME = ".venv-ref"
LOCK_NAME = ".venv-ref.lock"
MARKER_NAME = "deepinfer-ref-env.json"
ORACLE_SCRIPT = Path(__file__).resolve().with_name("hf_v4_oracle.py")

_WANTED = {
    "python": "%d.%d" % PY_MAJOR_MINOR,
    "torch": TORCH_VERSION,
    "transformers": TRANSFORMERS_VERSION,
}


def repo_root() -> Path:
    """The repository root (this file is ``<root>/tests/oracle/sideenv.py``)."""
    return Path(__file__).resolve().parents[2]


def _log(msg: str) -> None:
    print(f"[sideenv] {msg}", file=sys.stderr, flush=True)


def _env_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child environment that does not leak the main venv into the side one."""
    env = dict(os.environ)
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "__PYVENV_LAUNCHER__"):
        env.pop(key, None)
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if extra:
        env.update(extra)
    return env


def _marker_ok(env_dir: Path) -> bool:
    marker = env_dir / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if any(data.get(k) != v for k, v in _WANTED.items()):
        return False
    return _env_python(env_dir).exists()


def _probe(cmd: list[str], env: dict[str, str]) -> tuple[bool, str]:
    """True if ``cmd`` is a CPython 3.11 that has venv and ensurepip (Debian may lack the latter)."""
    code = (
        "import sys, venv, ensurepip; "
        "v = ensurepip.version(); "
        "print('%d.%d.%d' % sys.version_info[:3], sys.executable, v)"
    )
    try:
        r = subprocess.run(cmd + ["-c", code], env=env, capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout or "failed").strip().splitlines() or ["failed"]
        return False, lines[-1]
    out = r.stdout.strip()
    ver = out.split()[0] if out else ""
    ok = tuple(int(x) for x in ver.split(".")[:2]) == PY_MAJOR_MINOR if ver else False
    return ok, out


def _base_interpreters() -> list[tuple[list[str], dict[str, str]]]:
    """Candidate base interpreters, best first."""
    cands: list[tuple[list[str], dict[str, str]]] = []
    override = os.environ.get("DEEPINFER_REF_BASE_PYTHON")
    if override:
        cands.append(([override], _clean_env()))
    # pyenv's 3.11.7 (the machine default outside the repo; the repo's .python-version selects 3.12).
    cands.append((["python3"], _clean_env({"PYENV_VERSION": "3.11.7"})))
    pyenv_root = Path(os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv")))
    for p in sorted(pyenv_root.glob("versions/3.11*/bin/python3"), reverse=True):
        cands.append(([str(p)], _clean_env()))
    # The Debian system python3.11 only as a last resort (it may lack ensurepip).
    cands.append((["python3.11"], _clean_env()))
    return cands


def _run_logged(cmd: list[str], env: dict[str, str], what: str) -> None:
    _log(f"{what}: {' '.join(cmd)}")
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + "\n" + r.stderr).strip().splitlines()[-40:])
        raise RuntimeError(f"side env: {what} failed (rc {r.returncode}):\n{tail}")
    _log(f"{what}: done in {time.monotonic() - t0:.1f} s")


def _create(env_dir: Path) -> None:
    errors = []
    for cmd, env in _base_interpreters():
        ok, info = _probe(cmd, env)
        if not ok:
            errors.append(f"{' '.join(cmd)}: {info}")
            continue
        _log(f"base interpreter {' '.join(cmd)} -> {info}")
        if env_dir.exists():
            shutil.rmtree(env_dir)
        try:
            _run_logged(cmd + ["-m", "venv", str(env_dir)], env, "create venv")
        except RuntimeError as exc:
            errors.append(str(exc))
            shutil.rmtree(env_dir, ignore_errors=True)
            continue
        if _env_python(env_dir).exists() and (env_dir / "bin" / "pip").exists():
            return
        errors.append(f"{' '.join(cmd)}: venv has no pip")
        shutil.rmtree(env_dir, ignore_errors=True)
    raise RuntimeError("side env: no usable Python 3.11 with venv+ensurepip found:\n  " + "\n  ".join(errors))


def _installed_versions(py: Path) -> dict[str, str]:
    code = (
        "import json, sys, torch, transformers, safetensors, numpy; "
        "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
        "'torch': torch.__version__.split('+')[0], 'torch_full': torch.__version__, "
        "'cuda': torch.version.cuda, 'transformers': transformers.__version__, "
        "'safetensors': safetensors.__version__, 'numpy': numpy.__version__}))"
    )
    r = subprocess.run([str(py), "-c", code], env=_clean_env(), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"side env: version check failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _provision(env_dir: Path) -> None:
    py = _env_python(env_dir)
    usable = False
    if py.exists():
        ok, _ = _probe([str(py)], _clean_env())
        usable = ok
    if not usable:
        _create(env_dir)
    pip = [str(py), "-m", "pip", "install", "--progress-bar", "off", "-q"]
    env = _clean_env()
    # torch FIRST: the local CPU wheel exists only for cp311; any other resolution pulls CUDA builds.
    _run_logged(pip + [f"torch=={TORCH_VERSION}"], env, f"pip install torch=={TORCH_VERSION}")
    _run_logged(pip + [f"torch=={TORCH_VERSION}", f"transformers=={TRANSFORMERS_VERSION}",
                       "safetensors", "numpy"], env,
                f"pip install transformers=={TRANSFORMERS_VERSION} safetensors numpy")
    got = _installed_versions(py)
    bad = {k: (got.get(k), v) for k, v in _WANTED.items() if got.get(k) != v}
    if bad:
        raise RuntimeError(f"side env: wrong versions after install (got, wanted): {bad}")
    if got.get("cuda"):
        _log(f"warning: torch reports CUDA {got['cuda']}; expected the CPU wheel")
    (env_dir / MARKER_NAME).write_text(json.dumps({**got, **_WANTED}, indent=1) + "\n")
    _log(f"ready: {json.dumps(got)}")


def ensure_side_env(root: Path | None = None) -> Path:
    """Return the python executable of the side env, creating it under ``<root>/.venv-ref`` if needed."""
    root = Path(root) if root is not None else repo_root()
    env_dir = root / ENV_DIRNAME
    if _marker_ok(env_dir):
        return _env_python(env_dir)
    lock_path = root / LOCK_NAME
    with open(lock_path, "a+") as lock:
        t0 = time.monotonic()
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process provisioning {env_dir} ...")
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            _log(f"lock acquired after {time.monotonic() - t0:.1f} s")
        try:
            if not _marker_ok(env_dir):  # re-check: another process may have finished meanwhile
                _log(f"provisioning {env_dir} (torch {TORCH_VERSION}, transformers {TRANSFORMERS_VERSION})")
                t1 = time.monotonic()
                _provision(env_dir)
                _log(f"provisioned in {time.monotonic() - t1:.1f} s")
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return _env_python(env_dir)


def run_oracle(args: list[str], timeout: float = 600, root: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``hf_v4_oracle.py`` with ``args`` in the side env; raise with its stderr on failure."""
    py = ensure_side_env(root)
    cmd = [str(py), str(ORACLE_SCRIPT), *map(str, args)]
    env = _clean_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                      "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "TOKENIZERS_PARALLELISM": "false"})
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise RuntimeError(f"oracle timed out after {timeout} s: {' '.join(cmd)}\n{err[-6000:]}") from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"oracle failed (rc {proc.returncode}): {' '.join(cmd)}\n"
            f"--- stderr ---\n{proc.stderr[-8000:]}\n--- stdout ---\n{proc.stdout[-2000:]}")
    return proc


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="repository root (default: this checkout)")
    ap.add_argument("--check", action="store_true", help="only report whether the env is ready")
    a = ap.parse_args(argv)
    root = a.root if a.root is not None else repo_root()
    if a.check:
        ok = _marker_ok(root / ENV_DIRNAME)
        print("ready" if ok else "missing")
        return 0 if ok else 1
    t0 = time.monotonic()
    py = ensure_side_env(root)
    print(py)
    _log(f"total {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
