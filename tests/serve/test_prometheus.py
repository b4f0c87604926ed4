"""The shared Prometheus exposition (`serve/api/prometheus.py`) as the gRPC server's metrics use
it: cumulative histogram buckets, `_total` counters, finish-reason labels."""

from prometheus_client import generate_latest

from deepinfer.serve.api.prometheus import bucket_counts
from deepinfer.serve.grpc.metrics import ServerMetrics


def test_bucket_counts_put_a_sample_on_a_bound_in_that_bucket():
    assert bucket_counts((1.0, 2.0), [0.5, 1.0, 1.5, 3.0]) == [2, 1, 1]


def test_server_metrics_exposition():
    m = ServerMetrics()
    m.finished("stop", prompt_tokens=3, generation_tokens=5, e2e=0.3, queue_time=0.002)
    m.finished("length", prompt_tokens=40, generation_tokens=1, e2e=None, queue_time=None)
    text = generate_latest(m.registry(lambda: {"vllm:num_requests_running": 2.0}, "tiny")).decode()
    labels = 'engine="0",model_name="tiny"'
    assert f"vllm:num_requests_running{{{labels}}} 2.0" in text
    assert f"vllm:prompt_tokens_total{{{labels}}} 43.0" in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 1.0' in text
    # 3 and 40 prompt tokens: buckets are powers of two, cumulative (labels print sorted)
    assert f'vllm:request_prompt_tokens_bucket{{engine="0",le="2.0",model_name="tiny"}} 0.0' in text
    assert f'vllm:request_prompt_tokens_bucket{{engine="0",le="4.0",model_name="tiny"}} 1.0' in text
    assert f'vllm:request_prompt_tokens_bucket{{engine="0",le="64.0",model_name="tiny"}} 2.0' in text
    assert f'vllm:request_prompt_tokens_bucket{{engine="0",le="+Inf",model_name="tiny"}} 2.0' in text
    assert f"vllm:request_prompt_tokens_sum{{{labels}}} 43.0" in text


def test_spec_decode_counters_are_exposed_with_a_position_label():
    from deepinfer.serve.engine.speculative import SpecDecodeCounts

    counts = SpecDecodeCounts(block=3)
    for drafts, accepted in [(3, 3), (3, 1), (2, 0), (0, 0)]:  # (0, 0): a row that did not draft
        counts.record(drafts, accepted)
    assert counts.metrics()["vllm:spec_decode_num_accepted_tokens_per_pos"] == {"0": 2, "1": 1, "2": 1}
    text = generate_latest(ServerMetrics().registry(dict, "tiny", counts.metrics)).decode()
    labels = 'engine="0",model_name="tiny"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 3.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 8.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 4.0" in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} 1.0' in text
    # without speculative decoding nothing of it is exposed
    assert "spec_decode" not in generate_latest(ServerMetrics().registry(dict, "tiny")).decode()
