"""How users ask for a mesh and for many processes: `LLM(mesh=...)`, `deepinfer generate --mesh`,
`--coordinator/--num-processes/--process-id` (and their DEEPINFER_* defaults); every impossible
request is a clear error naming what is wrong."""

import pytest

from deepinfer.serve.api.llm import LLM
from deepinfer.serve.cli import EnvDefaults, build_parser, main
from deepinfer.sharding.distributed import DistributedConfig

SMALL = dict(max_model_len=256, page_size=64, prefill_chunk=128, log_stats_interval=None)


@pytest.mark.parametrize("mesh, shape", [("dp=2,cp=2,tp=2", (2, 2, 2)), ({"dp": 4, "cp": 2}, (4, 2, 1)),
                                         ("auto", (8, 1, 1))])
def test_llm_builds_the_mesh_it_is_given(checkpoint, mesh, shape):
    llm = LLM(checkpoint, mesh=mesh, max_num_seqs=8, **SMALL)
    assert tuple(llm.mesh.shape.values()) == shape
    assert llm.engine.cache.layout.dp == shape[0]
    # the routed experts really are split: one of the 8 experts per device
    w1 = llm.engine.runner.params["layers"][0]["ffn"]["experts"]["w1"]
    leaf = w1.q if hasattr(w1, "q") else w1
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {1}


@pytest.mark.parametrize("mesh, needle", [
    ("dp=3", "has 3 devices but 8 are available"),
    ("ep=8", "unknown mesh axis 'ep'"),
    ("dp=two", "size must be a positive integer"),
    (5, "mesh: must be a Mesh"),
])
def test_impossible_meshes_are_clear_errors(checkpoint, mesh, needle):
    with pytest.raises(ValueError, match="mesh") as e:
        LLM(checkpoint, mesh=mesh, **SMALL)
    assert needle in str(e.value)


def test_slots_must_split_over_dp(checkpoint):
    with pytest.raises(ValueError, match=r"max_num_seqs: 4 must be a multiple of the mesh's dp=8"):
        LLM(checkpoint, mesh="dp=8", max_num_seqs=4, **SMALL)


def test_cli_mesh_option_and_environment_default(capsys, checkpoint):
    args = build_parser(EnvDefaults(mesh="dp=4,cp=2")).parse_args(["generate", "--prompt", "x"])
    assert args.mesh == "dp=4,cp=2"
    code = main(["generate", "--model", checkpoint, "--prompt", "x", "--mesh", "dp=3"])
    err = capsys.readouterr().err
    assert code == 2 and "mesh" in err and "3 devices but 8 are available" in err and "Traceback" not in err


def test_cli_distributed_options_need_all_three(capsys, checkpoint):
    env = EnvDefaults(coordinator="127.0.0.1:1234", num_processes="2", process_id="1")
    args = build_parser(env).parse_args(["generate", "--prompt", "x"])
    assert (args.coordinator, args.num_processes, args.process_id) == ("127.0.0.1:1234", 2, 1)
    code = main(["generate", "--model", checkpoint, "--prompt", "x", "--coordinator", "127.0.0.1:1234"])
    err = capsys.readouterr().err
    assert code == 2 and "missing num-processes, process-id" in err


@pytest.mark.parametrize("config, needle", [
    (DistributedConfig("127.0.0.1", 2, 0), "host:port"),
    (DistributedConfig("127.0.0.1:80", 0, 0), "at least 1"),
    (DistributedConfig("127.0.0.1:80", 2, 2), "process_id must be in [0, 2)"),
    (DistributedConfig(None, 2, 0), "missing coordinator"),
])
def test_distributed_config_errors(config, needle):
    with pytest.raises(ValueError) as e:
        config.validate()
    assert needle in str(e.value)


def test_grpc_server_refuses_multi_process_options(capsys):
    code = main(["serve", "--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "runs in one process" in err


def test_eplb_options(checkpoint):
    llm = LLM(checkpoint, mesh="dp=8", eplb_interval=4, **SMALL)
    count = llm.engine.runner.params["layers"][0]["ffn"]["placement"]["count"]
    assert int(count.sum()) == 16  # default: the 8 experts plus one slot per device
    with pytest.raises(ValueError, match=r"eplb_slots \(12\) must be at least the 8 experts and a multiple of the 8"):
        LLM(checkpoint, mesh="dp=8", eplb_interval=4, eplb_slots=12, **SMALL)
    with pytest.raises(ValueError, match="eplb_interval"):
        LLM(checkpoint, eplb_interval=0, **SMALL)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--eplb-interval", "50", "--eplb-slots", "24"])
    assert (args.eplb_interval, args.eplb_slots) == (50, 24)


def test_run_batch_writes_results_only_on_process_0(capsys, checkpoint, tmp_path, monkeypatch):
    """In a multi-process run every process computes every line; the others must not write the
    output file (they would race process 0 on it)."""
    import json

    from deepinfer.sharding import distributed

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": "Hi", "max_tokens": 2}}) + "\n")
    monkeypatch.setattr(distributed, "is_primary", lambda: False)
    argv = ["run-batch", "-i", str(src), "-o", str(dst), "--model", checkpoint, "--max-num-seqs", "1",
            "--max-model-len", "256", "--page-size", "64", "--prefill-chunk", "128"]
    assert main(argv) == 0, capsys.readouterr().err
    assert not dst.exists()
    monkeypatch.setattr(distributed, "is_primary", lambda: True)
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(dst.read_text())["custom_id"] == "a"
