"""Ship a finished training run as the embedded `tiny-v4.1-trained` weights: the compact pack
(`deepinfer.model.compact_weights`) in `model/weights/`, with its SHA-256 and what it was
trained on in the JSON file beside it.

    python scripts/ship_tiny.py --out RUN_DIR
    python scripts/ship_tiny.py --out NEW_RUN_DIR --unpack   # the shipped target as a finished run

The target comes from RUN_DIR's finished target phase; the DSpark drafter from its drafter phase
when that has finished, else the drafter blocks are the seeded init (an untrained drafter, said
so in the JSON). Run from the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_drafter  # noqa: E402
import train_tiny as tt  # noqa: E402

from deepinfer.model.compact_weights import pack_arrays, save_pack  # noqa: E402
from deepinfer.model.config import to_hf_config  # noqa: E402
from deepinfer.model.params import init_params  # noqa: E402

WEIGHTS = pathlib.Path(__file__).resolve().parent.parent / "model" / "weights"


def unpack_run(out: str, pack_json: str | pathlib.Path = WEIGHTS / "tiny-v4.1-trained.json") -> dict:
    """The reverse: a run directory whose finished target is the shipped one (its rounded
    weights, a fresh optimizer state), so that the drafter phase (`train_tiny.py --phase
    drafter`) runs on it in a later session. Returns the setup of `train_tiny.setup`."""
    import tempfile

    from deepinfer.model.checkpoint import load_checkpoint
    from deepinfer.model.compact_weights import load_pack, write_checkpoint_from_pack
    from deepinfer.model.config import config_from_dict

    pack_json = pathlib.Path(pack_json)
    info = json.loads(pack_json.read_text())
    run = tt.RunConfig(out=str(out), seed=info["seed"], **info["target"])
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(out) / "run.json").write_text(json.dumps(dataclasses.asdict(run), indent=1))
    s = tt.setup(run)
    pack = pack_json.parent / info["file"]
    used = load_pack(pack, info["sha256"])["__used_ids__"]
    if not np.array_equal(used, s["used"]):
        raise SystemExit(f"{pack}: trained on another vocabulary subset than this interpreter's corpus gives")
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint_from_pack(pack, config_from_dict(info["config"], name=s["config"].name), info["seed"], tmp,
                                   info["sha256"])
        _, full = load_checkpoint(tmp, dequantize=True, dtype="float32")
    full.pop("mtp", None)
    ids = np.asarray(used)
    params = jax.tree.map(lambda a: a, s["state"]["params"])
    for key, value in full.items():
        params[key] = value[ids] if key in ("embed", "head") else value
    state = {"params": params, "opt_state": s["optimizer"].init(params), "step": run.steps}
    tt.save(s["mngr"], state)
    s["state"] = state
    return s


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the training run directory")
    ap.add_argument("--name", default="tiny-v4.1-trained")
    ap.add_argument("--dest", default=str(WEIGHTS), help="directory of the pack and its JSON (default model/weights)")
    ap.add_argument("--unpack", action="store_true",
                    help="the reverse: make --out a run directory whose finished target is the shipped one")
    args = ap.parse_args(argv)
    if args.unpack:
        s = unpack_run(args.out)
        return {"unpacked": args.out, "step": s["state"]["step"]}
    run_dir = pathlib.Path(args.out)
    run = tt.RunConfig(**json.loads((run_dir / "run.json").read_text()))
    s, target = train_drafter.load_target(run)
    config, used = s["config"], s["used"]
    params = tt.export_params(target, config, used, run.seed)

    drafter_note = "untrained (the seeded init)"
    mtp = init_params(config, run.seed)["mtp"]
    drafter_json = run_dir / "run-drafter.json"
    if drafter_json.is_file():
        drun = tt.RunConfig(**json.loads(drafter_json.read_text()))
        state, _ = train_drafter.drafter_state(drun, config, used)
        if state["step"] >= drun.steps:
            mtp = train_drafter.export_drafter(state["params"], config, used, run.seed)
            drafter_note = f"trained ({drun.steps} steps)"
    if drafter_note.startswith("untrained"):  # its vocabulary rows as a trained drafter's would be
        markov = mtp[-1]["markov_head"]
        ids = np.asarray(used)
        mtp = train_drafter.export_drafter(
            [*mtp[:-1], {**mtp[-1], "markov_head": {"embed": markov["embed"][ids], "head": markov["head"][ids]}}],
            config, used, run.seed)
    params["mtp"] = jax.device_get(mtp)

    dest = pathlib.Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{args.name}.npz"
    sha = save_pack(pack_arrays(jax.device_get(params), config, used), path)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    heldout = [m for m in metrics if "heldout_loss" in m]
    info = {
        "file": path.name, "sha256": sha, "bytes": path.stat().st_size, "seed": run.seed,
        "architecture": "tiny-v4.1", "used_tokens": int(len(used)),
        "target": {k: getattr(run, k) for k in ("steps", "batch", "seq_len", "lr", "warmup", "weight_qat")},
        "heldout_loss": heldout[-1]["heldout_loss"] if heldout else None,
        "drafter": drafter_note,
        "config": to_hf_config(config),
    }
    sts = run_dir / "sts.json"
    if sts.is_file() and not drafter_note.startswith("untrained"):  # the drafter's fitted confidence temperatures
        info["sts"] = json.loads(sts.read_text())
    (dest / f"{args.name}.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    main()
