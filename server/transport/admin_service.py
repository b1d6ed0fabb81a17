"""The coordinator's admin service: `hydrafl admin ... --coordinator` from another machine, on the coordinator's
gRPC server beside the sites' service and with the same bounds.

Who is calling: an administrator's bearer token (`hydrafl admin token create`, kept hashed), never a site's;
failed logins are throttled per address, audited, and never lock a valid token out (`authentication.TokenGate`).
What it may ask: one action of `Administration` by name, with a JSON object of arguments whose names, types and
string lengths are checked before anything runs; requests over MAX_ADMIN_REQUEST_BYTES are refused unparsed
(`handlers`) as are arguments over MAX_ARGUMENTS_BYTES, and each administrator has at most `max_calls` calls in flight.

Status codes: wrong, missing or revoked admin token (or a site's) -> UNAUTHENTICATED; an unknown action, a
malformed or oversize argument, a refusal of the action itself (no such run, a run that cannot stop) ->
INVALID_ARGUMENT with the reason; too many calls or failed logins -> RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import grpc

from hydrafl.app_bundle import MAX_BUNDLE_BYTES
from hydrafl.bounded import MAX_NAME_CHARS, bounded
from hydrafl.proto import admin_pb2 as pb
from hydrafl.server.administration import Administration
from hydrafl.server.store import Store
from hydrafl.server.tables import AdminToken
from hydrafl.server.transport import limits as bounds
from hydrafl.server.transport.authentication import TokenGate, peer_address

log = logging.getLogger(__name__)

MAX_ARGUMENTS_BYTES = 64 << 10
"""An admin request's arguments: a run's configuration is a few kilobytes."""
MAX_ADMIN_REQUEST_BYTES = MAX_ARGUMENTS_BYTES + MAX_BUNDLE_BYTES
"""The arguments, and a run's app bundle."""
MAX_PATH_CHARS = 4096
EXPORT_PIECE_BYTES = 1 << 20
ACTIONS: dict[str, dict[str, type]] = {
    "sites": {},
    "add_site": {"name": str},
    "revoke_site": {"name": str},
    "create_run": {"config": dict, "server_app": str},
    "runs": {},
    "run_status": {"run_id": int},
    "run_logs": {"run_id": int, "offset": int},
    "stop_run": {"run_id": int, "now": bool},
    "resume_run": {"run_id": int},
}
"""The `Administration` methods an administrator may call remotely, and their arguments' types (a str argument
may also be null: "no ServerApp")."""


class AdminService:
    def __init__(self, store: Store, runs_dir: Path, limits: bounds.SiteLimits) -> None:
        self.store = store
        self.runs_dir = runs_dir
        self.gate = TokenGate(store, limits, store.admin_token_hashes)
        self.guard = bounds.CallGuard(limits)

    def stop(self) -> None:
        self.guard.stop()

    def _admin(self, context: grpc.ServicerContext) -> AdminToken:
        admin = self.store.authenticate_admin(self.gate.token(context))
        if admin is None:
            self.gate.failed(context, "unknown or revoked admin token")
        return admin

    @contextmanager
    def _acting(self, context: grpc.ServicerContext) -> Iterator[Administration]:
        """The caller's Administration, its calls in flight bounded; a refused action is INVALID_ARGUMENT."""
        admin = self._admin(context)
        actor = f"admin {admin.name} from {peer_address(context)}"
        try:
            with self.guard.call(-admin.id):  # negative: never a site's node id
                yield Administration(self.store, self.runs_dir, actor)
        except bounds.LimitExceeded as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, bounded(error))
        except (ValueError, FileNotFoundError) as error:
            _invalid(context, f"{actor}: refused", str(error))

    def Call(self, request: pb.AdminCall, context: grpc.ServicerContext) -> pb.AdminResult:
        with self._acting(context) as administration:
            arguments = _arguments(request, context)
            if request.app_bundle:
                if request.action != "create_run":
                    _invalid(context, request.action, "only create_run takes an app bundle")
                arguments["app_bundle"] = request.app_bundle
            result = getattr(administration, request.action)(**arguments)
            return pb.AdminResult(result=json.dumps(result).encode())

    def ExportModel(
        self, request: pb.ExportRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ExportPiece]:
        """Export on the coordinator into a temporary folder, then stream its files in pieces."""
        if len(request.data) > MAX_PATH_CHARS:
            _invalid(context, "export", f"data path over {MAX_PATH_CHARS} characters")
        with self._acting(context) as administration, tempfile.TemporaryDirectory() as folder:
            kind = administration.export(request.run_id, Path(folder), request.data)
            for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
                path = file.relative_to(folder).as_posix()
                with file.open("rb") as handle:
                    while True:
                        data = handle.read(EXPORT_PIECE_BYTES)
                        yield pb.ExportPiece(path=path, data=data, kind=kind)
                        kind = ""
                        if len(data) < EXPORT_PIECE_BYTES:
                            break


def _arguments(request: pb.AdminCall, context: grpc.ServicerContext) -> dict[str, Any]:
    """The call's arguments, each checked against its action's signature; anything else aborts."""
    if len(request.arguments) > MAX_ARGUMENTS_BYTES:
        _invalid(context, "call", f"arguments over {MAX_ARGUMENTS_BYTES} bytes")
    expected = ACTIONS.get(request.action)
    if expected is None:
        _invalid(context, "call", f"no admin action {bounded(request.action, MAX_NAME_CHARS)!r}")
    try:
        arguments = json.loads(request.arguments or b"{}")
    except (ValueError, UnicodeDecodeError):
        _invalid(context, request.action, "its arguments are not a JSON object")
    if not isinstance(arguments, dict) or set(arguments) - set(expected):
        _invalid(context, request.action, f"it takes the arguments {sorted(expected)}")
    for name, kind in expected.items():
        value = arguments.get(name)
        if value is None and kind is str:
            continue
        # bool is an int in Python, and an id must not be one
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            _invalid(context, request.action, f"argument {name!r} must be a {kind.__name__}")
        if isinstance(value, str) and len(value) > MAX_NAME_CHARS:
            _invalid(context, request.action, f"argument {name!r} over {MAX_NAME_CHARS} characters")
        if isinstance(value, dict) and any(len(key) > MAX_NAME_CHARS for key in value):
            _invalid(context, request.action, f"a key of {name!r} over {MAX_NAME_CHARS} characters")
    return arguments


def _invalid(context: grpc.ServicerContext, what: str, reason: str) -> NoReturn:
    reason = bounded(reason)
    log.warning("admin %s: %s", what, reason)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
