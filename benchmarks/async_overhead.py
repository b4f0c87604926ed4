"""Synchronous vs asynchronous scheduling on `tiny-v4.1` (random weights): output tokens/s at
several batch sizes, and how long the device waits for the host between consecutive steps.

    python benchmarks/async_overhead.py [--batch-sizes 1,8,32] [--input-len 128] [--output-len 64]

Device idle time comes from timestamps: a watcher thread waits for each dispatched device step
in order (on one element sliced from the cache it returns, ready when the step is done) and
records when it finished. A step starts when it was dispatched or when the previous one
finished, whichever is later; the idle time before it is the part of the gap between the
previous step's end and its dispatch, i.e. the host's critical path. Figures are per engine step
(all its device programs together) and printed as a fraction of the device's busy time. Each
configuration runs once untimed (compilation) before it is measured; both modes share the
compiled programs.
"""

from __future__ import annotations

import argparse
import queue
import threading
import time

import jax
import numpy as np

from deepinfer.model import init_params, load_config
from deepinfer.model.tokenizer import load_tokenizer
from deepinfer.serve.api.types import SamplingParams
from deepinfer.serve.engine.cache import CacheBudget
from deepinfer.serve.engine.engine import EngineConfig, LLMEngine


class StepClock:
    """Dispatch and completion times of every device program the runner launches."""

    def __init__(self, runner):
        self.dispatched: list[float] = []
        self.done: list[float] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        original = runner.run

        def run(*args, **kwargs):
            out = original(*args, **kwargs)
            self.dispatched.append(time.perf_counter())
            # the step's cache is donated to the next step before the watcher can wait on it:
            # wait on one element sliced from it (a program queued after the step, not donated)
            self._queue.put(jax.tree.leaves(runner.cache)[0].reshape(-1)[:1])
            return out

        runner.run = run

    def _watch(self) -> None:
        while True:
            array = self._queue.get()
            if array is None:
                return
            array.block_until_ready()
            self.done.append(time.perf_counter())

    def close(self) -> tuple[float, float]:
        """(device busy seconds, device idle seconds between programs) since the clock started."""
        self._queue.put(None)
        self._thread.join()
        busy = idle = 0.0
        previous_end = None
        for dispatched, done in zip(self.dispatched, self.done):
            start = dispatched if previous_end is None else max(dispatched, previous_end)
            if previous_end is not None:
                idle += max(0.0, dispatched - previous_end)
            busy += done - start
            previous_end = done
        return busy, idle


def measure(model, batch: int, input_len: int, output_len: int, async_scheduling: bool) -> dict:
    config, params, tokenizer = model
    budget = CacheBudget(num_slots=batch, max_model_len=input_len + output_len + 128)
    engine = LLMEngine(params, config, tokenizer, EngineConfig(budget=budget, async_scheduling=async_scheduling))
    rng = np.random.default_rng(batch)
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0, seed=None)
    result = {}
    for timed in (False, True):
        for i in range(batch):
            engine.add_request(f"{timed}-{i}", [0] + rng.integers(3, 128000, input_len - 1).tolist(), sampling)
        clock = StepClock(engine.runner) if timed else None
        start, steps, generated = time.perf_counter(), 0, 0
        while engine.has_unfinished():
            generated += sum(len(o.outputs[0].token_ids) for o in engine.step())
            steps += 1
        elapsed = time.perf_counter() - start
        if timed:
            busy, idle = clock.close()
            result = {"tok_s": generated / elapsed, "steps": steps, "elapsed": elapsed, "busy": busy, "idle": idle}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    config = load_config("tiny-v4.1")
    model = (config, init_params(config, seed=0), load_tokenizer())
    print(f"tiny-v4.1 on {jax.devices()[0].platform}: input {args.input_len}, output {args.output_len} tokens, "
          "temperature 1")
    print(f"{'batch':>5} {'mode':>5} {'out tok/s':>10} {'steps':>6} {'device idle / busy':>19} {'idle ms/step':>12}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        figures = {}
        for async_scheduling in (False, True):
            r = measure(model, batch, args.input_len, args.output_len, async_scheduling)
            figures[async_scheduling] = r
            mode = "async" if async_scheduling else "sync"
            print(f"{batch:>5} {mode:>5} {r['tok_s']:>10.1f} {r['steps']:>6} {r['idle'] / r['busy']:>18.1%} "
                  f"{1000 * r['idle'] / r['steps']:>12.2f}", flush=True)
        print(f"{batch:>5} async/sync output tok/s: {figures[True]['tok_s'] / figures[False]['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
