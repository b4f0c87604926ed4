"""`deepinfer kernels`: which implementation of each hot op runs here, and why.

Wiring (in serve/cli.py's `build_parser`): `add_kernels_parser(sub, accelerator_env=(NAME, VALUE))`
(the accelerator's environment variable and its raw value, read there); the parser's `func` is
`run_kernels`, which returns the exit code. `--accelerator` resolves for that accelerator's platform (an absent backend or
plugin is an error, exit code 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from deepinfer.pallas_kernels.accelerator import ACCELERATORS, normalize, select_accelerator
from deepinfer.pallas_kernels.registry import BACKENDS, KernelConfig, KernelUnavailableError, describe, platform_info


def _op_pin(text: str) -> tuple[str, str]:
    op, sep, backend = text.partition("=")
    if not sep or not op or not backend:
        raise argparse.ArgumentTypeError(f"expected OP=BACKEND, got {text!r}")
    return op, backend


def add_kernels_parser(subparsers, accelerator_env: tuple[str, str | None] | None = None) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kernels", help="list the kernel implementation each hot op uses here, and why")
    p.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                   help="kernel backend to resolve for (default auto: chosen from the platform)")
    p.add_argument("--op", dest="ops", action="append", type=_op_pin, default=[], metavar="OP=BACKEND",
                   help="pin one op to a backend (repeatable)")
    p.add_argument("--accelerator", choices=ACCELERATORS, default=None,
                   help="resolve for this accelerator's platform (default: "
                        + (f"${accelerator_env[0]}, else " if accelerator_env else "") + "auto)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of aligned lines")
    p.set_defaults(func=run_kernels, accelerator_env=accelerator_env)
    return p


def run_kernels(args: argparse.Namespace) -> int:
    backend = None if args.backend == "auto" else args.backend
    variable, value = getattr(args, "accelerator_env", None) or (None, None)
    try:
        name = args.accelerator or (normalize(value, variable) if value else "auto")
        platform = select_accelerator(name).backend
        rows = describe(KernelConfig(backend=backend, ops=tuple(args.ops), platform=platform))
    except (KernelUnavailableError, KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"deepinfer kernels: error: {msg}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"platform": platform_info(platform).describe(),
                          "ops": [{"op": op, "implementation": impl, "reason": why} for op, impl, why in rows]},
                         indent=2))
        return 0
    w_op = max(len(op) for op, _, _ in rows)
    w_impl = max(len(impl) for _, impl, _ in rows)
    for op, impl, why in rows:
        print(f"{op:<{w_op}}  {impl:<{w_impl}}  {why}")
    return 0
