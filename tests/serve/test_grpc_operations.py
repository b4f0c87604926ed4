"""Operating the gRPC server: health and graceful drain, bearer tokens, TLS, the queue limit,
binding rules and the `deepinfer serve` command (`grpc_harness.py` holds what the gRPC tests
share)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from deepinfer.serve.grpc import deepinfer_engine_pb2 as pb
from deepinfer.serve.grpc import deepinfer_engine_pb2_grpc as pb_grpc
from deepinfer.serve.grpc.server import SERVICE_NAME, LoadedModel, ServerSettings, ServerThread
from tests.serve.grpc_harness import (TOKEN, collect, health_status, list_services, make_engine, prompt_ids, request,
                                      slow_steps, wait_released)
from tests.serve.grpc_harness import model  # noqa: F401 - the shared fixture


# ---- health, drain, auth, TLS, limits -----------------------------------------------------------


def test_health_transitions_and_graceful_drain(model):
    gate = threading.Event()

    def loader():  # "loading the weights" until the test lets it finish
        assert gate.wait(120)
        return LoadedModel(make_engine(model), model_name="drain-test")

    srv = ServerThread(loader, ServerSettings(port=0, shutdown_grace_s=1.0, warmup=False))
    port = srv.start()
    registry = srv.server.metrics_registry()  # made while loading, as `deepinfer serve` does
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.LlmEngineStub(ch)
            for service in ("", SERVICE_NAME):
                assert health_status(ch, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as e:
                collect(stub, request(prompt_ids(8, 1), max_new_tokens=2))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
            gate.set()
            assert srv.wait_ready(300)
            from prometheus_client import generate_latest

            assert 'model_name="drain-test"' in generate_latest(registry).decode()  # the served model
            for service in ("", SERVICE_NAME):
                assert health_status(ch, service) == health_pb2.HealthCheckResponse.SERVING

            with slow_steps(srv, 0.05):
                short = stub.Generate(request(prompt_ids(8, 2), temperature=0.0, max_new_tokens=3, ignore_eos=True),
                                      timeout=60)
                long = stub.Generate(request(prompt_ids(8, 3), temperature=0.0, max_new_tokens=50, ignore_eos=True),
                                     timeout=60)
                first_short, first_long = next(short), next(long)
                assert first_short.WhichOneof("response") == first_long.WhichOneof("response") == "chunk"
                drain = threading.Thread(target=srv.shutdown, kwargs={"grace": 1.0})
                drain.start()
                deadline = time.monotonic() + 5
                while health_status(ch) != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                assert health_status(ch, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
                assert srv.server.active_requests >= 1  # still draining
                with pytest.raises(grpc.RpcError) as e:
                    collect(stub, request(prompt_ids(8, 4), max_new_tokens=2))
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                short_rest, long_rest = list(short), list(long)
                drain.join(60)
        assert short_rest[-1].complete.finish_reason == "length"  # finished within the grace period
        assert long_rest[-1].complete.finish_reason == "abort"  # aborted when the grace period ran out
        assert srv.server.state == "STOPPED" and not srv.server.driver.is_alive()
        engine = srv.server.engine
        assert engine.cache.pages.free == engine.cache.layout.num_pages
        assert engine.cache.free_slots == engine.cache.layout.num_slots
    finally:
        gate.set()
        srv.shutdown(grace=0)


def _self_signed_cert(directory: Path):
    if shutil.which("openssl") is None:
        return None
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def secure(model, tmp_path_factory):
    """A server with a bearer token, TLS (when openssl is there) and a queue of one beyond the slots."""
    tls = _self_signed_cert(tmp_path_factory.mktemp("tls"))
    settings = ServerSettings(port=0, auth_token=TOKEN, max_queue=1, shutdown_grace_s=0.5, warmup=False,
                              tls_cert=str(tls[0]) if tls else None, tls_key=str(tls[1]) if tls else None)
    srv = ServerThread(lambda: make_engine(model), settings)
    srv.start()
    assert srv.wait_ready(300)
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=tls[0].read_bytes())
        ch = grpc.secure_channel(f"127.0.0.1:{srv.port}", creds,
                                 options=[("grpc.ssl_target_name_override", "localhost")])
    else:
        ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    yield srv, ch, tls is not None
    ch.close()
    srv.shutdown(grace=0)


def test_bearer_token_on_every_rpc(secure):
    srv, ch, _ = secure
    stub = pb_grpc.LlmEngineStub(ch)
    good = (("authorization", f"Bearer {TOKEN}"),)
    for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        for call in (lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30),
                     lambda md: stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=30),
                     lambda md: stub.Abort(pb.AbortRequest(request_id="x"), metadata=md, timeout=30),
                     lambda md: stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=md, timeout=30),
                     lambda md: collect(stub, request(prompt_ids(8, 1), max_new_tokens=2), metadata=md),
                     lambda md: list_services(ch, metadata=md)):
            with pytest.raises(grpc.RpcError) as e:
                call(metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good, timeout=30).vocab_size == 129280
    for scheme in ("bearer", "BEARER", "bEaReR"):  # the scheme is case-insensitive (RFC 7235)
        md = (("authorization", f"{scheme} {TOKEN}"),)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30).vocab_size == 129280
    for value in (f"Basic {TOKEN}", "Bearer", f"Bearer {TOKEN.upper()}", f"Bearer {TOKEN}x"):
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", value),), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, value
    _, complete, _ = collect(stub, request(prompt_ids(8, 1), temperature=0.0, max_new_tokens=2), metadata=good)
    assert complete.completion_tokens == 2
    assert SERVICE_NAME in list_services(ch, metadata=good)
    # the standard health service stays open (load balancers probe it without credentials)
    assert health_status(ch) == health_pb2.HealthCheckResponse.SERVING
    assert "<set>" == srv.server.settings.public_dict()["auth_token"]


def test_tls_rejects_plaintext_clients(secure):
    srv, _, tls = secure
    if not tls:
        pytest.skip("openssl is not installed: no certificate to test TLS with")
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as plain:
        with pytest.raises(grpc.RpcError) as e:
            health_status(plain)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_queue_limit_gives_resource_exhausted(secure):
    srv, ch, _ = secure
    stub = pb_grpc.LlmEngineStub(ch)
    md = (("authorization", f"Bearer {TOKEN}"),)
    calls = []
    with slow_steps(srv, 0.03):
        try:
            for i in range(5):  # 4 slots + a queue of 1
                calls.append(stub.Generate(request(prompt_ids(8, 20 + i), temperature=0.0, max_new_tokens=50,
                                                   ignore_eos=True), metadata=md, timeout=60))
            deadline = time.monotonic() + 30
            while srv.server.active_requests < 5:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as e:
                collect(stub, request(prompt_ids(8, 30), max_new_tokens=2), metadata=md)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue" in e.value.details()
        finally:
            for call in calls:
                call.cancel()
    wait_released(srv)
    _, complete, _ = collect(stub, request(prompt_ids(8, 30), temperature=0.0, max_new_tokens=2), metadata=md)
    assert complete.completion_tokens == 2


def test_bad_tls_files_are_named_before_binding(model, tmp_path, capsys):
    from deepinfer.serve.grpc.cli import run_serve
    from deepinfer.serve.grpc.tls import TlsFileError

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    tls, other = _self_signed_cert(tmp_path / "a"), _self_signed_cert(tmp_path / "b")
    if tls is None:
        pytest.skip("openssl is not installed: no certificate to test TLS with")
    (cert, key), (_, other_key) = tls, other
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    for c, k, flag, named, needle in ((garbage, key, "--tls-cert", garbage, "no PEM certificate"),
                                      (key, key, "--tls-cert", key, "no PEM certificate"),
                                      (cert, garbage, "--tls-key", garbage, "no PEM private key"),
                                      (cert, cert, "--tls-key", cert, "no PEM private key"),
                                      (cert, other_key, "--tls-key", other_key, "does not match the certificate")):
        assert run_serve(_serve_args("--tls-cert", str(c), "--tls-key", str(k))) == 2
        err = capsys.readouterr().err
        assert f"{flag}: " in err and str(named) in err and needle in err and "Failed to bind" not in err, err
        # an embedding program gets the same error from start(), before anything binds
        srv = ServerThread(lambda: make_engine(model),
                           ServerSettings(port=0, tls_cert=str(c), tls_key=str(k), warmup=False))
        with pytest.raises(TlsFileError, match=needle):
            srv.start()


def test_a_non_loopback_bind_needs_tls_or_a_token(tmp_path, capsys):
    from deepinfer.serve.grpc.cli import build_settings, run_serve

    for host in ("0.0.0.0", "::", "192.0.2.7", "example.com"):
        with pytest.raises(ValueError, match="allow_insecure_remote"):
            ServerSettings(host=host)
        assert ServerSettings(host=host, auth_token=TOKEN).host == host
        assert ServerSettings(host=host, allow_insecure_remote=True).host == host
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert ServerSettings(host=host).exposure().endswith("(loopback only), TLS off, bearer-token auth off")
    settings = ServerSettings(host="0.0.0.0", auth_token=TOKEN, port=7)
    assert settings.exposure() == ("0.0.0.0:7 (reachable from other machines), TLS off, "
                                   "bearer-token auth on (health service open)")
    assert run_serve(_serve_args("--host", "0.0.0.0")) == 2
    assert "--allow-insecure-remote" in capsys.readouterr().err
    assert build_settings(_serve_args("--host", "::", "--allow-insecure-remote")).allow_insecure_remote
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    assert build_settings(_serve_args("--host", "0.0.0.0", "--auth-token-file", str(token_file))).auth_token == TOKEN


# ---- the `serve` command ------------------------------------------------------------------------


def _serve_args(*argv: str):
    import argparse

    from deepinfer.serve.grpc.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="deepinfer")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_command_rejects_bad_arguments(tmp_path, capsys):
    from deepinfer.serve.grpc.cli import run_serve

    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    spaced = tmp_path / "spaced-token"
    spaced.write_text("two words\n")
    for argv, needle in ((["--port", "70000"], "--port"),
                         (["--tls-cert", str(empty)], "--tls-cert and --tls-key"),
                         (["--auth-token-file", str(empty)], "is empty"),
                         (["--auth-token-file", str(spaced)], "one line without spaces"),
                         (["--auth-token-file", str(tmp_path / "missing")], "cannot read"),
                         (["--auth-health"], "--auth-health"),
                         (["--max-queue", "-1"], "--max-queue"),
                         (["--max-concurrent-streams", "0"], "--max-concurrent-streams"),
                         (["--prefill-chunk", "100"], "multiple of 128"),
                         (["--model", str(tmp_path / "nowhere")], "--model")):
        args = _serve_args(*argv)
        assert args.func is run_serve
        assert run_serve(args) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
    args = _serve_args()
    assert (args.host, args.port) == ("127.0.0.1", 50051)  # loopback by default


def test_serve_command_serves_and_drains_on_sigterm(tmp_path):
    import os
    import signal

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    script = ("import argparse, sys\n"
              "from deepinfer.serve.grpc.cli import add_serve_parser\n"
              "p = argparse.ArgumentParser()\n"
              "add_serve_parser(p.add_subparsers())\n"
              "a = p.parse_args(sys.argv[1:])\n"
              "sys.exit(a.func(a))\n")
    stderr = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-c", script, "serve", "--port", "0", "--auth-token-file", str(token_file), "--no-warmup",
         "--max-model-len", "256", "--max-num-seqs", "2", "--page-size", "64", "--prefill-chunk", "128",
         "--served-model-name", "cli-test", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)})  # the embedded model is written there
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, (line, (tmp_path / "stderr.log").read_text())
        assert "(loopback only), TLS off, bearer-token auth on (health service open)" in line, line
        port = int(line.split("127.0.0.1:")[1].split()[0])
        line = proc.stdout.readline()
        assert "Prometheus metrics on http://127.0.0.1:" in line, line
        metrics_url = line.split("metrics on ")[1].strip()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            deadline = time.monotonic() + 120
            while health_status(ch) != health_pb2.HealthCheckResponse.SERVING:  # open without the token
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.log").read_text()
                time.sleep(0.2)
            stub = pb_grpc.LlmEngineStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),),
                                     timeout=10)
            assert info.served_model_name == "cli-test" and info.max_context_length == 256
        import urllib.request

        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            exposition = r.read().decode()
        assert 'vllm:num_requests_running{engine="0",model_name="cli-test"} 0.0' in exposition
        assert "vllm:time_to_first_token_seconds_bucket" in exposition
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert "draining" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
