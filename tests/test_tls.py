"""The gateway's TLS ports (--ssl-certfile / --ssl-keyfile, service_kit/tls.py) on the real stack (verifier and
gateway processes; random tiny model), with a throwaway CA from trustme: gRPC and HTTPS clients that trust the CA
are served, as `ddtree health --tls-ca` is; plaintext clients and clients that do not trust it are refused."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import sys

import grpc
import pytest
import trustme
from stack import (GATEWAY, HOST, PROMPTS, free_port, gen_request, generate, new_stack, pb, tiny_ckpt,  # noqa: F401
                   wait_until)

from ddtree.v1 import generation_pb2_grpc as pb_grpc
from gateway.config import GatewayConfig
from grpc_health.v1 import health_pb2, health_pb2_grpc


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    authority = trustme.CA()
    cert = authority.issue_cert("localhost", HOST)
    files = {"ca": d / "ca.pem", "cert": d / "chain.pem", "key": d / "key.pem"}
    authority.cert_pem.write_to_path(str(files["ca"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(files["cert"]), append=True)
    return files


def _secure(address: str, ca_file) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes()))


def _serving(address: str, ca_file) -> bool:
    with _secure(address, ca_file) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=GATEWAY), timeout=1)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


@pytest.fixture(scope="module")
def stack(request, tiny_ckpt, tmp_path_factory, ca):
    with new_stack(request, tiny_ckpt, tmp_path_factory) as st:
        st.add_verifier()
        st.http_port = free_port()
        st.add_gateway("--ssl-certfile", str(ca["cert"]), "--ssl-keyfile", str(ca["key"]),
                       "--http-port", str(st.http_port), wait=False)
        wait_until(lambda: _serving(st.gateway.address, ca["ca"]), 90, "the TLS gateway SERVING",
                   procs=st.live_procs)
        yield st


def test_grpc_over_tls(stack, ca):
    with _secure(stack.gateway.address, ca["ca"]) as ch:
        got = generate(pb_grpc.GenerationStub(ch), gen_request(PROMPTS[0], 6))
    assert len(got.ids) == 6 and got.final.finish_reason == pb.FINISH_REASON_LENGTH


def test_plaintext_and_untrusted_grpc_clients_are_refused(stack, tmp_path):
    with pytest.raises(grpc.RpcError) as e:
        generate(stack.generation, gen_request(PROMPTS[0], 2), timeout=5)  # the stack's plaintext channel
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    with _secure(stack.gateway.address, other) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GenerationStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_https(stack, ca):
    ctx = ssl.create_default_context(cafile=str(ca["ca"]))
    conn = http.client.HTTPSConnection(HOST, stack.http_port, context=ctx, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[0], "max_tokens": 4}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 4
    plain = http.client.HTTPConnection(HOST, stack.http_port, timeout=5)
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        plain.request("GET", "/health")
        plain.getresponse().read()


@pytest.mark.parametrize("args, ok", [
    (["--tls-ca", "{ca}"], True),
    (["--tls-ca", "{ca}", "--tls-server-name", "localhost"], True),  # the certificate also names localhost
    (["--tls-ca", "{ca}", "--tls-server-name", "llm.example.com"], False),  # ... but not this host
    ([], False),  # plaintext
    (["--tls"], False),  # the system's roots do not hold the test CA
])
def test_health_command_over_tls(stack, ca, args, ok):
    """The container health check's command: exit 0 only when it can verify the gateway and it is SERVING."""
    r = subprocess.run([sys.executable, "-m", "service_kit.cli", "health", f"--address={stack.gateway.address}",
                        f"--service={GATEWAY}", *[a.format(ca=ca["ca"]) for a in args]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == (0 if ok else 1), r.stderr + r.stdout


def test_config_needs_both_files():
    for pair in ({"ssl_certfile": "c.pem"}, {"ssl_keyfile": "k.pem"}):
        with pytest.raises(ValueError, match="ssl_certfile, ssl_keyfile"):
            GatewayConfig(model="m", **pair)
    assert GatewayConfig(model="m", ssl_certfile="c.pem", ssl_keyfile="k.pem").ssl_keyfile == "k.pem"
