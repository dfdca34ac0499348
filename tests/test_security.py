"""TLS, mutual TLS and API keys, with certificates made in the fixture (openssl): a client without a
certificate or key is refused, a right one is served; health stays open."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.security import ApiKeys
from specdec.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import RawSession, collect
from tests.servers import LOOPBACK, OrchestratorThread, orchestrator_config, start_target

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # signed by another CA
    stranger_key: Path
    second_cert: Path  # another client of the same CA
    second_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
             "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return cert, key


def _signed(folder: Path, name: str, ca: tuple[Path, Path], san: str) -> tuple[Path, Path]:
    key, csr, cert, ext = (folder / f"{name}.{s}" for s in ("key", "csr", "pem", "ext"))
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = _ca(folder, "ca"), _ca(folder, "other-ca")
    server = _signed(folder, "server", ca, "IP:127.0.0.1,DNS:localhost")
    client = _signed(folder, "client", ca, "DNS:orchestrator")
    stranger = _signed(folder, "stranger", other, "DNS:stranger")
    second = _signed(folder, "second-client", ca, "DNS:second")
    return Pki(ca[0], *server, *client, *stranger, *second)


def _creds(pki: Pki, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
    )


def _info(address: str, credentials: grpc.ChannelCredentials) -> common_pb2.ModelInfo:
    with grpc.secure_channel(address, credentials) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)


def test_mutual_tls_refuses_clients_without_the_right_certificate(pki, target_model):
    server = start_target(
        target_model, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca),
        health_port=0,
    )  # fmt: skip
    address = f"{LOOPBACK}:{server.port}"
    try:
        assert _info(address, _creds(pki, pki.client_cert, pki.client_key)).vocab_size == 96
        for credentials in (_creds(pki), _creds(pki, pki.stranger_cert, pki.stranger_key)):
            with pytest.raises(grpc.RpcError) as error:
                _info(address, credentials)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError):
            target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5)
    finally:
        server.stop()


def test_streams_are_budgeted_per_certificate_under_mutual_tls(pki, target_model):
    """Under mutual TLS a client is its certificate, not its address: a second stream with the first
    client's certificate is refused at a budget of one, another client's, from the same address, is not."""
    server = start_target(
        target_model, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca),
        max_streams_per_peer=1,
    )  # fmt: skip
    address = f"{LOOPBACK}:{server.port}"
    step = target_pb2.VerifyRequest(keep=0, append_token_ids=[3, 4], num_rows=1)
    try:
        with grpc.secure_channel(address, _creds(pki, pki.client_cert, pki.client_key)) as first_channel:
            held = RawSession(target_pb2_grpc.TargetServiceStub(first_channel).Verify)
            assert held.step(step).result == common_pb2.SESSION_RESULT_OK
            with grpc.secure_channel(address, _creds(pki, pki.client_cert, pki.client_key)) as same:
                refused = RawSession(target_pb2_grpc.TargetServiceStub(same).Verify)
                with pytest.raises(grpc.RpcError) as error:
                    refused.step(step)
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "client" in error.value.details() and "--max-streams-per-peer" in error.value.details()
            with grpc.secure_channel(address, _creds(pki, pki.second_cert, pki.second_key)) as other:
                second = RawSession(target_pb2_grpc.TargetServiceStub(other).Verify)
                assert second.step(step).result == common_pb2.SESSION_RESULT_OK
                second.close()
            held.close()
    finally:
        server.stop()


def test_orchestrator_over_tls_with_api_keys(pki, target_model, tmp_path):
    from tools.local_stack import free_port

    target = start_target(
        target_model, tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca)
    )
    keys = tmp_path / "keys"
    keys.write_text("# one key a line\nfirst-key\n\nsecond-key\n")
    health_port = free_port()
    orchestrator = OrchestratorThread(
        orchestrator_config(
            target,
            upstream_tls_ca=str(pki.ca),
            upstream_tls_cert=str(pki.client_cert),
            upstream_tls_key=str(pki.client_key),
            api_key_file=str(keys),
            tls_cert=str(pki.server_cert),
            tls_key=str(pki.server_key),
            health_port=health_port,
        )
    )
    request = orchestrator_pb2.GenerateRequest(text="w1 w2", max_new_tokens=4)
    try:
        with grpc.secure_channel(orchestrator.address, _creds(pki)) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "first-key"),)):
                with pytest.raises(grpc.RpcError) as error:
                    list(stub.Generate(request, metadata=metadata))
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization: Bearer" in error.value.details()
            ids = [
                t
                for m in stub.Generate(request, metadata=(("authorization", "Bearer second-key"),))
                for t in m.token_ids
            ]
            assert len(ids) == 4
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # no key needed
        with grpc.insecure_channel(f"{LOOPBACK}:{health_port}") as channel:  # the plaintext probe port
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == 1
        with grpc.insecure_channel(orchestrator.address) as channel, pytest.raises(grpc.RpcError):
            collect(orchestrator_pb2_grpc.OrchestratorStub(channel), request)  # plaintext to a TLS port
    finally:
        orchestrator.stop()
        target.stop()


def test_api_keys_reload_when_the_file_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alpha\n")
    keys = ApiKeys(str(path), check_interval_s=0.0)
    assert keys.accepts((("authorization", "Bearer alpha"),))
    assert not keys.accepts((("authorization", "Bearer beta"),))
    path.write_text("beta\ngamma\n")
    assert keys.accepts((("authorization", "bearer beta"),)) and not keys.accepts((("authorization", "Bearer alpha"),))
    path.unlink()
    assert keys.accepts((("authorization", "Bearer gamma"),))  # an unreadable file keeps the keys it had
    assert not keys.accepts(None) and not keys.accepts((("authorization", "Bearer "),))
