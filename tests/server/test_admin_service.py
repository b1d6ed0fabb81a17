"""The coordinator's admin service against hostile callers on loopback: only an administrator's token opens it
(never a site's), failed logins are throttled without locking a valid administrator out, and megabyte strings,
oversize or malformed messages, unknown actions and mistyped arguments are refused with a clear status and
change nothing. Both ways in (`--db` and `--coordinator`) answer alike."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from helpers import local_coordinator

from hydrafl.app_bundle import load_bundle
from hydrafl.bounded import MAX_DETAIL_CHARS
from hydrafl.cli.admin_client import RemoteAdministration
from hydrafl.proto import admin_pb2 as pb
from hydrafl.proto.admin_pb2_grpc import AdminStub
from hydrafl.server.administration import Administration
from hydrafl.server.transport.limits import SiteLimits

MEGABYTE = "x" * (1 << 20)


@pytest.fixture
def live(tmp_path):
    coordinator = local_coordinator(tmp_path, limits=SiteLimits(max_auth_failures=3))
    store = coordinator.store
    site_token = store.add_site("st-marys")[1]
    admin_token = store.add_admin("alice")
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    yield coordinator, AdminStub(channel), admin_token, site_token, channel
    channel.close()
    coordinator.stop()


def _call(stub: AdminStub, token: str | None, action: str, **arguments) -> object:
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    request = pb.AdminCall(action=action, arguments=json.dumps(arguments).encode())
    return json.loads(stub.Call(request, metadata=metadata, timeout=10).result)


def _refused(code: grpc.StatusCode, call, *args, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call(*args, **kwargs)
    assert refused.value.code() == code, refused.value.details()
    return refused.value.details()


def test_only_an_administrators_token_opens_the_admin_service(live):
    coordinator, stub, admin_token, site_token, _ = live
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    assert "no 'authorization" in _refused(unauthenticated, _call, stub, None, "sites")
    for token in ("not-a-token", site_token):  # a site's token is no admin's
        assert _refused(unauthenticated, _call, stub, token, "sites") == (
            "unknown or revoked admin token"
        )
    assert [site["name"] for site in _call(stub, admin_token, "sites")] == ["st-marys"]
    coordinator.store.revoke_admin("alice")
    _refused(unauthenticated, _call, stub, admin_token, "sites")
    audit = coordinator.store.audit_events
    failures = audit("auth-failed") + audit("auth-throttled")  # the third is the throttle's: max 3
    assert len(failures) == 3 and all("ipv4:127.0.0.1" in event.detail for event in failures)


def test_failed_logins_are_throttled_but_never_lock_out_a_valid_administrator(live):
    _, stub, admin_token, _, _ = live
    for _ in range(3):
        _refused(grpc.StatusCode.UNAUTHENTICATED, _call, stub, "guess", "sites")
    throttled = _refused(grpc.StatusCode.RESOURCE_EXHAUSTED, _call, stub, "guess", "runs")
    assert "too many failed authentications" in throttled
    assert _call(stub, admin_token, "runs") == []  # the same address, a valid token: served


def test_megabyte_strings_oversize_and_malformed_calls_are_refused_and_change_nothing(live):
    coordinator, stub, admin_token, _, channel = live
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    store = coordinator.store
    run = store.create_run({"strategy": "fedavg", "rounds": 2})
    refusals = {
        "an oversize request": (MEGABYTE[:100], {"name": MEGABYTE}),
        "a megabyte action": (MEGABYTE, {}),
        "an unknown action": ("__init__", {}),
        "the store itself": ("store", {}),
        "an argument over its bound": ("add_site", {"name": "n" * 300}),
        "a site name over its column": ("add_site", {"name": "n" * 200}),
        "a string id": ("run_status", {"run_id": "1"}),
        "a boolean id": ("run_status", {"run_id": True}),
        "an extra argument": ("runs", {"all": True}),
        "a missing argument": ("stop_run", {"now": True}),
        "no such run": ("stop_run", {"run_id": 99, "now": False}),
        "a run that cannot stop twice": ("resume_run", {"run_id": run.id}),
    }
    for what, (action, arguments) in refusals.items():
        details = _refused(invalid, _call, stub, admin_token, action, **arguments)
        assert len(details) <= MAX_DETAIL_CHARS + 40, what
    not_json = pb.AdminCall(action="runs", arguments=b"{not json")
    metadata = (("authorization", f"Bearer {admin_token}"),)
    assert "not a JSON object" in _refused(invalid, stub.Call, not_json, metadata=metadata)
    for bundle, action, reason in [
        (b"PK-not-a-zip", "create_run", "not a Flower app bundle"),
        (b"x", "runs", "only create_run takes an app bundle"),
        (b"x" * (5 << 20), "create_run", "AdminCall of"),  # over the request's bound
    ]:
        arguments = json.dumps({"config": {}, "server_app": "a:b"} if action != "runs" else {})
        call = pb.AdminCall(action=action, arguments=arguments.encode(), app_bundle=bundle)
        assert reason in _refused(invalid, stub.Call, call, metadata=metadata)
    raw = channel.unary_unary("/hydrafl.proto.Admin/Call")
    assert "malformed AdminCall" in _refused(invalid, raw, b"\xff\xff\xff", metadata=metadata)
    gigantic = pb.AdminCall(action="runs", arguments=b"x" * (9 << 20))
    _refused(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.Call, gigantic, metadata=metadata)
    export = pb.ExportRequest(run_id=run.id, data=MEGABYTE[:5000])
    _refused(invalid, lambda: list(stub.ExportModel(export, metadata=metadata)))
    no_model = pb.ExportRequest(run_id=run.id)
    assert "holds no checkpoint" in _refused(
        invalid, lambda: list(stub.ExportModel(no_model, metadata=metadata))
    )

    assert [site.name for site in store.sites()] == ["st-marys"]
    assert [(r.id, r.status, r.stop_requested) for r in store.runs()] == [(run.id, "pending", "")]
    assert all(len(event.detail) <= MAX_DETAIL_CHARS + 40 for event in store.audit_events())


def test_both_ways_in_answer_alike_and_every_action_is_audited(live, tmp_path):
    coordinator, _, admin_token, _, _ = live
    store = coordinator.store
    local = Administration(store, tmp_path / "runs", "local tester")
    remote = RemoteAdministration(f"127.0.0.1:{coordinator.port}", admin_token)
    created = remote.create_run({"strategy": "fedavg", "rounds": 2}, None)
    assert remote.runs() == local.runs() and remote.sites() == local.sites()
    assert remote.run_status(created["id"]) == local.run_status(created["id"])
    assert remote.stop_run(created["id"]) == {"status": "stopped"}  # pending: stopped at once
    for way in (local, remote):
        with pytest.raises(ValueError, match="only a pending or running run stops"):
            way.stop_run(created["id"])
    remote.resume_run(created["id"])
    assert store.run(created["id"]).status == "pending"
    bundle = load_bundle(Path(__file__).resolve().parents[1] / "assets" / "quickapp_project")
    shipped = remote.create_run(bundle.config, bundle.server_app, bundle.data)["id"]
    assert store.app_bundle(shipped) == bundle.data
    actions = [event.detail for event in store.audit_events("admin")]
    by_alice = [a.split(": ", 1)[1] for a in actions if a.startswith("admin alice from ipv4:")]
    assert by_alice == [
        "run create fedavg",
        "run list",
        "site list",
        "run status",
        "run stop",
        "run stop",
        "run resume",
        f"run create quickapp.server_app:app from app bundle sha256:{bundle.digest}",
    ]
    assert sum(a.startswith("local tester: ") for a in actions) == 4
