"""Where the suite's time goes: wall time and JAX compilation per test module.

Opt-in pytest plugin (`python -m pytest -n 2 tests -p tests.compile_report --compile-report DIR`):
each process (xdist worker or the lone pytest process) appends one line per test phase to
`DIR/<worker>.tsv`, with the phase's wall seconds and what JAX itself recorded meanwhile
(`jax.monitoring`: XLA compilation, tracing + lowering, persistent-cache hits), and one line per
XLA compilation to `DIR/<worker>.compiles.tsv` (test, jitted function, seconds); at the end the
controlling process prints the modules by worker time and the functions by compile time. Compilation in subprocesses (the CLI and
multi-process tests) is not seen.
"""

from __future__ import annotations

import collections
import glob
import os

import pytest

# (the events of tests/serve/compilations.py, named here: importing it would import the engine,
# and so JAX, before tests/conftest.py has set up the platform)
_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_HIT = "/jax/compilation_cache/cache_hits"

_seconds: collections.Counter = collections.Counter()
_events: collections.Counter = collections.Counter()
_compiles: list[tuple[str, float]] = []  # (jitted function, seconds) of the current test phase
_out = None
_compiles_out = None


def pytest_addoption(parser):
    parser.addoption("--compile-report", metavar="DIR", default=None,
                     help="write per-test wall and JAX compile seconds under DIR and print a per-module summary")


def _record(event: str, duration_secs: float, fun_name: str = "?", **_) -> None:
    _seconds.update({event: duration_secs})
    if event == _COMPILE:
        _compiles.append((fun_name, duration_secs))


def pytest_configure(config):
    global _out, _compiles_out
    directory = config.getoption("--compile-report")
    if directory is None:
        return
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_record)
    jax.monitoring.register_event_listener(lambda event, **_: _events.update({event: 1}))
    os.makedirs(directory, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None or not getattr(config.option, "numprocesses", None):  # (an xdist controller runs no test)
        _out = open(os.path.join(directory, f"{worker or 'main'}.tsv"), "a", buffering=1)
        _compiles_out = open(os.path.join(directory, f"{worker or 'main'}.compiles.tsv"), "a", buffering=1)


def pytest_runtest_logreport(report):
    if _out is None:
        return
    trace = sum(_seconds[k] for k in _TRACE)
    _out.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\t{_seconds[_COMPILE]:.2f}\t{trace:.2f}"
               f"\t{_events[_HIT]}\n")
    for fun_name, secs in _compiles:
        _compiles_out.write(f"{report.nodeid}\t{fun_name}\t{secs:.2f}\n")
    _seconds.clear()
    _events.clear()
    _compiles.clear()


def summary(directory: str, top: int = 30) -> list[str]:
    """The modules by wall seconds: wall, compile, trace + lower, cache hits, tests."""
    modules = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0, 0])
    for path in set(glob.glob(os.path.join(directory, "*.tsv"))) - set(glob.glob(os.path.join(directory, "*.compiles.tsv"))):
        for line in open(path):
            nodeid, when, wall, compile_s, trace, hits = line.rstrip("\n").split("\t")
            row = modules[nodeid.split("::")[0]]
            row[0] += float(wall)
            row[1] += float(compile_s)
            row[2] += float(trace)
            row[3] += int(hits)
            row[4] += when == "call"
    total = [sum(r[i] for r in modules.values()) for i in range(3)]
    lines = [f"worker seconds {total[0]:.0f}: XLA compile {total[1]:.0f}, trace + lower {total[2]:.0f}"]
    for name, (wall, compile_s, trace, hits, tests) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{wall:7.0f} s  compile {compile_s:6.0f}  trace {trace:5.0f}  hits {hits:4d}"
                     f"  tests {tests:4d}  {name}")
    functions = collections.defaultdict(lambda: [0.0, 0])
    for path in glob.glob(os.path.join(directory, "*.compiles.tsv")):
        for line in open(path):
            _, fun_name, secs = line.rstrip("\n").split("\t")
            functions[fun_name][0] += float(secs)
            functions[fun_name][1] += 1
    lines.append("XLA compile seconds by jitted function (compilations, seconds):")
    for name, (secs, count) in sorted(functions.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{secs:7.0f} s  {count:5d}  {name}")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    directory = config.getoption("--compile-report")
    if directory is None or "PYTEST_XDIST_WORKER" in os.environ:
        return
    if _out is not None:
        _out.flush()
    terminalreporter.section("compile report")
    for line in summary(directory):
        terminalreporter.write_line(line)
