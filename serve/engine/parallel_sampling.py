"""Parallel sampling (`SamplingParams.n > 1`): one request, n independent samples of its prompt.

As in vLLM, the engine runs the n samples as n child requests (ids `"{index}_{request_id}"`,
`n=1`) that are scheduled, preempted and stopped on their own, and returns one `RequestOutput`
under the parent's id once all of them finished, its `outputs` the children's completions in
index order (`CompletionOutput.index`). Child `index` samples with the parent's seed + index
(vLLM's rule), so a seeded request gives the same n samples in any batch; a request without a
seed gets one from the engine first, as a single request does. Each child prefills the prompt
itself: with the prefix cache on, children admitted after the first's pages are published hit
them.
"""

from __future__ import annotations

import dataclasses

from deepinfer.serve.engine.types import RequestMetrics, RequestOutput, SamplingParams

__all__ = ["SampleGroup", "SampleGroups", "child_id", "child_ids"]


def child_id(request_id: str, index: int) -> str:
    """The engine id of sample `index` of `request_id` (vLLM's form)."""
    return f"{index}_{request_id}"


def child_ids(request_id: str, n: int) -> list[str]:
    return [child_id(request_id, i) for i in range(n)]


@dataclasses.dataclass
class SampleGroup:
    """The children of one parallel-sampling request and the outputs of those that finished."""

    request_id: str
    n: int
    finished: dict[int, RequestOutput] = dataclasses.field(default_factory=dict)

    @property
    def child_ids(self) -> list[str]:
        return child_ids(self.request_id, self.n)

    @staticmethod
    def child_params(params: SamplingParams, index: int, seed: int) -> SamplingParams:
        """Sample `index`'s params: one sample, the group's seed + index."""
        return dataclasses.replace(params, n=1, seed=seed + index)

    def add(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """Record child `index`'s final output; the merged output once all n are in."""
        self.finished[index] = output
        return self.merged() if len(self.finished) == self.n else None

    def merged(self) -> RequestOutput:
        """One `RequestOutput` under the parent's id: the children's completions by index, the
        prompt (and its cached tokens) of sample 0, the earliest and latest of their times."""
        outputs = [self.finished[i] for i in sorted(self.finished)]
        completions = [dataclasses.replace(o.outputs[0], index=i) for i, o in zip(sorted(self.finished), outputs)]
        first = outputs[0]
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, first.prompt_logprobs,
                             completions, all(o.finished for o in outputs), _merged_metrics(outputs),
                             first.num_cached_tokens)


class SampleGroups:
    """An engine's parallel-sampling requests: each group by its request id, each child's group
    and index. The engine queues and aborts the children; this holds their outputs until a
    group is complete."""

    def __init__(self):
        self._groups: dict[str, SampleGroup] = {}
        self._group_of: dict[str, tuple[SampleGroup, int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def open(self, request_id: str, n: int) -> SampleGroup:
        group = SampleGroup(request_id, n)
        self._groups[request_id] = group
        for i, cid in enumerate(group.child_ids):
            self._group_of[cid] = (group, i)
        return group

    def sample_ids(self, request_id: str) -> list[str]:
        """The engine ids of `request_id`'s samples by index: its children, or itself."""
        group = self._groups.get(request_id)
        return [request_id] if group is None else group.child_ids

    def close(self, request_id: str) -> tuple[SampleGroup, list[tuple[int, str]]] | None:
        """Forget the group of `request_id` (an abort): the group and its samples not finished
        yet, as (index, id), which the engine aborts into the group; None when it is no group."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        return group, [(i, cid) for i, cid in enumerate(group.child_ids) if self._group_of.pop(cid, None) is not None]

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` with those of samples held by their group until its last sample finishes,
        then returned as one output under the request's id."""
        if not self._group_of:
            return outputs
        gathered = []
        for output in outputs:
            entry = self._group_of.pop(output.request_id, None)
            if entry is None:
                gathered.append(output)
                continue
            group, index = entry
            merged = group.add(index, output)
            if merged is not None:
                del self._groups[group.request_id]
                gathered.append(merged)
        return gathered


def _merged_metrics(outputs: list[RequestOutput]) -> RequestMetrics | None:
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    if not metrics:
        return None

    def pick(name: str, choose):
        values = [getattr(m, name) for m in metrics if getattr(m, name) is not None]
        return choose(values) if values else None

    return RequestMetrics(arrival_time=min(m.arrival_time for m in metrics),
                          first_scheduled_time=pick("first_scheduled_time", min),
                          first_token_time=pick("first_token_time", min),
                          last_token_time=pick("last_token_time", max),
                          finished_time=pick("finished_time", max))
