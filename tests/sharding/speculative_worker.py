"""One process of the two-process DSpark run in tests/sharding/test_multiprocess.py.

    python -m tests.sharding.speculative_worker COORDINATOR PROCESS_ID CHECKPOINT OUT.json

Joins the two-process runtime (`jax.distributed`, one CPU device each), builds an `LLM` on a
dp=2 mesh over both processes (one attention rank each) with confidence-scheduled DSpark,
generates `requests()` and writes what this process saw to OUT.json: the verify-step costs its
schedule uses, the outputs (tokens, text, finish reason, logprobs) and the spec-decode counters.

Each process is given its own step-cost curve (`STEP_SECONDS`; as if each host had profiled its
own): by process 0's every width pays, by process 1's none does, so a process that used its own
would decode plainly while the other verifies, and their collectives would never meet."""

from __future__ import annotations

import json
import sys

PROMPTS = ("The capital of France is", "Once upon a time", "Answer in lower case:")
REGEX = "[a-z]{2,8}( [a-z]{2,8}){2,3}"
# one device per process: what must agree across processes is the verify width of every dp rank's
# step (the cp/tp collectives of a wider mesh are test_two_processes_generate_the_one_process_tokens')
MESH, DEVICES_PER_PROCESS = "dp=2", 1
ENGINE = dict(max_num_seqs=4, max_model_len=256, page_size=64, prefill_chunk=128, log_stats_interval=None)
SPECULATIVE = {"method": "dspark", "num_speculative_tokens": 2, "enable_adaptive_verification": True}
# per process: a plain decode step's seconds, then a verify step's at 1 and 2 drafts per row
STEP_SECONDS = ([0.125, 0.125, 0.125], [0.125, 8.0, 16.0])  # (exact in float32, as broadcast)


def requests():
    """(prompt, SamplingParams): two greedy requests with their top-2 logprobs, one constrained by REGEX."""
    from deepinfer.serve.api.types import SamplingParams, StructuredOutputsParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    constrained = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=REGEX))
    return [(PROMPTS[0], greedy), (PROMPTS[1], greedy), (PROMPTS[2], constrained)]


def record(outputs) -> list[dict]:
    """The outputs as JSON: token ids, text, finish reason and per token {id: logprob}."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        out.append({"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": None if c.logprobs is None else
                    [{str(t): lp.logprob for t, lp in position.items()} for position in c.logprobs]})
    return out


def main(coordinator: str, process_id: str, checkpoint: str, path: str) -> None:
    from deepinfer.sharding.distributed import DistributedConfig, initialize

    initialize(DistributedConfig(coordinator, 2, int(process_id)))
    from deepinfer import LLM

    speculative = dict(SPECULATIVE, verify_step_seconds=STEP_SECONDS[int(process_id)])
    llm = LLM(checkpoint, mesh=MESH, speculative_config=speculative, **ENGINE)
    prompts, params = zip(*requests())
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    counts = llm.engine.spec_counts
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"step_seconds": list(map(float, llm.engine.verify_schedule.step_seconds)),
                   "outputs": record(outputs),
                   "num_drafts": counts.num_drafts, "num_accepted_tokens": counts.num_accepted_tokens,
                   "kinds": sorted({key[0] for key in llm.engine.runner.compile_seconds})}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
