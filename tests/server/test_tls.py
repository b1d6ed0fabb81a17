"""TLS and mutual TLS with certificates generated here: a site without a valid certificate is refused."""

from __future__ import annotations

import datetime
import ipaddress
import threading

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from helpers import local_coordinator

from hydrafl.client.agent import SiteAgent
from hydrafl.client.site_app import client_app
from hydrafl.client.tls import SiteTls
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.server.coordinator import Coordinator
from hydrafl.server.transport.tls import ServerTls


def _certificate(name: str, issuer_key, issuer_name, *, ca: bool, san: bool):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(folder, name, key, cert):
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return folder / f"{name}.pem", folder / f"{name}.key"


@pytest.fixture
def pki(tmp_path):
    ca_key, ca_cert = _certificate("hydrafl test CA", None, None, ca=True, san=False)
    rogue_key, rogue_cert = _certificate("rogue CA", None, None, ca=True, san=False)
    files = {"ca": _write(tmp_path, "ca", ca_key, ca_cert)[0]}
    files["server"] = _write(
        tmp_path,
        "server",
        *_certificate("coordinator", ca_key, ca_cert.subject, ca=False, san=True),
    )
    files["site"] = _write(
        tmp_path, "site", *_certificate("st-marys", ca_key, ca_cert.subject, ca=False, san=False)
    )
    files["rogue"] = _write(
        tmp_path,
        "rogue",
        *_certificate("intruder", rogue_key, rogue_cert.subject, ca=False, san=False),
    )
    return files


def _coordinator(tmp_path, pki, mutual: bool) -> Coordinator:
    cert, key = pki["server"]
    tls = ServerTls(cert=cert, key=key, client_ca=pki["ca"] if mutual else None)
    return local_coordinator(tmp_path, tls=tls)


def _join(port: int, token: str, credentials) -> str:
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        reply = CoordinatorStub(channel).Join(
            pb.JoinRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=10
        )
    return reply.site_name


def test_tls_server_authentication(tmp_path, pki):
    coordinator = _coordinator(tmp_path, pki, mutual=False)
    try:
        _, token = coordinator.store.add_site("st-marys")
        trusted = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        assert _join(coordinator.port, token, trusted) == "st-marys"
        wrong_ca = grpc.ssl_channel_credentials(root_certificates=pki["rogue"][0].read_bytes())
        with pytest.raises(grpc.RpcError) as refused:
            _join(coordinator.port, token, wrong_ca)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with (
            grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as plain,
            pytest.raises(grpc.RpcError),
        ):
            CoordinatorStub(plain).Join(pb.JoinRequest(), timeout=5)
    finally:
        coordinator.stop()


def test_mutual_tls_refuses_sites_without_a_valid_certificate(tmp_path, pki):
    coordinator = _coordinator(tmp_path, pki, mutual=True)
    try:
        _, token = coordinator.store.add_site("st-marys")
        ca = pki["ca"].read_bytes()
        site_cert, site_key = pki["site"]
        good = grpc.ssl_channel_credentials(ca, site_key.read_bytes(), site_cert.read_bytes())
        assert _join(coordinator.port, token, good) == "st-marys"
        rogue_cert, rogue_key = pki["rogue"]
        for credentials in (
            grpc.ssl_channel_credentials(ca),
            grpc.ssl_channel_credentials(ca, rogue_key.read_bytes(), rogue_cert.read_bytes()),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                _join(coordinator.port, token, credentials)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        agent = SiteAgent(
            f"127.0.0.1:{coordinator.port}",
            token,
            client_app,
            {},
            tls=SiteTls(ca=pki["ca"], cert=site_cert, key=site_key),
        )
        stop = threading.Event()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        for _ in range(100):
            if agent.node_id:
                break
            stop.wait(0.1)
        stop.set()
        thread.join(timeout=10)
        assert agent.node_id == coordinator.store.sites()[0].node_id
    finally:
        coordinator.stop()


def test_a_mutual_tls_certificate_authenticates_only_the_site_it_was_issued_to(tmp_path, pki):
    """A valid certificate of st-marys with the token of another site is refused, and the refusal audited."""
    coordinator = _coordinator(tmp_path, pki, mutual=True)
    try:
        _, token_marys = coordinator.store.add_site("st-marys")
        _, token_other = coordinator.store.add_site("general")
        site_cert, site_key = pki["site"]
        credentials = grpc.ssl_channel_credentials(
            pki["ca"].read_bytes(), site_key.read_bytes(), site_cert.read_bytes()
        )
        assert _join(coordinator.port, token_marys, credentials) == "st-marys"
        with pytest.raises(grpc.RpcError) as refused:
            _join(coordinator.port, token_other, credentials)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "was not issued to site 'general'" in refused.value.details()
        [event] = coordinator.store.audit_events("auth-failed")
        assert "st-marys" in event.detail and "general" in event.detail
    finally:
        coordinator.stop()


def test_an_administrator_reaches_a_mutual_tls_coordinator_with_a_certificate_of_its_ca(
    tmp_path, pki
):
    from hydrafl.cli.admin_client import RemoteAdministration

    coordinator = _coordinator(tmp_path, pki, mutual=True)
    try:
        token = coordinator.store.add_admin("alice")
        address = f"127.0.0.1:{coordinator.port}"
        cert, key = pki["site"]
        admin = RemoteAdministration(address, token, SiteTls(ca=pki["ca"], cert=cert, key=key))
        assert admin.create_run({"strategy": "fedavg", "rounds": 1}) == {"id": 1}
        assert [run["id"] for run in admin.runs()] == [1]
        without_certificate = RemoteAdministration(address, token, SiteTls(ca=pki["ca"]))
        with pytest.raises(ConnectionError, match="cannot reach the coordinator"):
            without_certificate.runs()
    finally:
        coordinator.stop()
