"""Where `hydrafl admin` acts: on the coordinator's database (`--db`, the `Administration` itself) or through the
coordinator's admin service from another machine (`--coordinator HOST:PORT --admin-token-file F`,
`RemoteAdministration`). Both have the methods of `AdminApi`, so each command is written once."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import typer

from hydrafl.cli.common import DbOption, fail_one_line, open_store, warn

if TYPE_CHECKING:
    from hydrafl.client.tls import SiteTls
    from hydrafl.proto import admin_pb2

CoordinatorOption = Annotated[
    str | None,
    typer.Option(
        "--coordinator",
        envvar="HYDRAFL_ADMIN_COORDINATOR",
        help="Administer this coordinator (HOST:PORT) over the network instead of its database.",
    ),
]
AdminTokenFileOption = Annotated[
    Path | None,
    typer.Option(
        "--admin-token-file",
        envvar="HYDRAFL_ADMIN_TOKEN_FILE",
        help="With --coordinator: the file holding your admin token (`hydrafl admin token create`).",
    ),
]
AdminTlsCaOption = Annotated[
    Path | None,
    typer.Option(
        "--tls-ca", help="With --coordinator: the CA of the coordinator's TLS certificate."
    ),
]
AdminTlsCertOption = Annotated[
    Path | None,
    typer.Option(
        "--tls-cert",
        help="With --coordinator serving mutual TLS: your certificate (with --tls-key, --tls-ca).",
    ),
]
AdminTlsKeyOption = Annotated[
    Path | None, typer.Option("--tls-key", help="With --tls-cert: its private key.")
]
RunsOption = Annotated[
    Path | None,
    typer.Option("--runs", help="With --db: run folders (default: $HYDRAFL_HOME/runs)."),
]


class AdminApi(Protocol):
    """What every `hydrafl admin` command that works from another machine calls (`Administration`'s methods)."""

    def sites(self) -> list[dict[str, Any]]: ...
    def add_site(self, name: str) -> dict[str, Any]: ...
    def revoke_site(self, name: str) -> dict[str, Any]: ...
    def create_run(
        self,
        config: dict[str, Any],
        server_app: str | None = None,
        app_bundle: bytes | None = None,
    ) -> dict[str, Any]: ...
    def runs(self) -> list[dict[str, Any]]: ...
    def run_status(self, run_id: int) -> dict[str, Any]: ...
    def run_logs(self, run_id: int, offset: int = 0) -> dict[str, Any]: ...
    def stop_run(self, run_id: int, now: bool = False) -> dict[str, Any]: ...
    def resume_run(self, run_id: int) -> dict[str, Any]: ...
    def export(self, run_id: int, out: Path, data: str = "") -> str: ...


class RemoteAdministration:
    """`Administration` through the coordinator's admin service; a refusal is a ValueError with its reason, as
    from `Administration` itself, and a failed login or an unreachable coordinator a ConnectionError."""

    def __init__(self, address: str, token: str, tls: SiteTls | None = None) -> None:
        import grpc

        from hydrafl.client.tls import plaintext_warning
        from hydrafl.proto.admin_pb2_grpc import AdminStub
        from hydrafl.protocol import GRPC_OPTIONS

        warning = plaintext_warning(address, tls)
        if warning:
            warn(warning.replace("every update", "every answer"))
        self.address = address
        self.channel = (
            grpc.insecure_channel(address, options=GRPC_OPTIONS)
            if tls is None
            else grpc.secure_channel(address, tls.credentials(), options=GRPC_OPTIONS)
        )
        self.stub = AdminStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _call(self, action: str, app_bundle: bytes = b"", **arguments: Any) -> Any:
        from hydrafl.proto import admin_pb2

        request = admin_pb2.AdminCall(
            action=action, arguments=json.dumps(arguments).encode(), app_bundle=app_bundle
        )
        try:
            reply = self.stub.Call(request, metadata=self.metadata, timeout=60)
        except Exception as error:
            raise self._refusal(error) from None
        return json.loads(reply.result)

    def _refusal(self, error: Exception) -> Exception:
        import grpc

        if not isinstance(error, grpc.RpcError):
            return error
        code, details = error.code(), error.details()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ValueError(details)
        if code == grpc.StatusCode.UNAVAILABLE:
            return ConnectionError(f"cannot reach the coordinator at {self.address}: {details}")
        return ConnectionError(f"the coordinator at {self.address} refused: {details}")

    def sites(self) -> list[dict[str, Any]]:
        return self._call("sites")

    def add_site(self, name: str) -> dict[str, Any]:
        return self._call("add_site", name=name)

    def revoke_site(self, name: str) -> dict[str, Any]:
        return self._call("revoke_site", name=name)

    def create_run(
        self,
        config: dict[str, Any],
        server_app: str | None = None,
        app_bundle: bytes | None = None,
    ) -> dict[str, Any]:
        return self._call("create_run", app_bundle or b"", config=config, server_app=server_app)

    def runs(self) -> list[dict[str, Any]]:
        return self._call("runs")

    def run_status(self, run_id: int) -> dict[str, Any]:
        return self._call("run_status", run_id=run_id)

    def run_logs(self, run_id: int, offset: int = 0) -> dict[str, Any]:
        return self._call("run_logs", run_id=run_id, offset=offset)

    def stop_run(self, run_id: int, now: bool = False) -> dict[str, Any]:
        return self._call("stop_run", run_id=run_id, now=now)

    def resume_run(self, run_id: int) -> dict[str, Any]:
        return self._call("resume_run", run_id=run_id)

    def export(self, run_id: int, out: Path, data: str = "") -> str:
        """The coordinator exports; its files land in `out` (none outside it); returns the export's kind."""
        from hydrafl.proto import admin_pb2

        pieces = self.stub.ExportModel(
            admin_pb2.ExportRequest(run_id=run_id, data=data), metadata=self.metadata
        )
        try:
            return _write_pieces(pieces, out)
        except Exception as error:
            raise self._refusal(error) from None


def _write_pieces(pieces: Iterator[admin_pb2.ExportPiece], out: Path) -> str:
    """Write the streamed files under `out`, refusing any path that leaves it; returns the export's kind."""
    kind, written = "", set[str]()
    out.mkdir(parents=True, exist_ok=True)
    for piece in pieces:
        kind = kind or piece.kind
        relative = PurePosixPath(piece.path)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(f"the coordinator sent a file outside the export: {piece.path!r}")
        target = out.joinpath(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("ab" if piece.path in written else "wb") as handle:
            handle.write(piece.data)
        written.add(piece.path)
    return kind


@dataclass(frozen=True, kw_only=True, slots=True)
class Place:
    """Where a command acts, as its options say: this machine's database, or a coordinator's admin service."""

    db: str | None = None
    runs: Path | None = None
    coordinator: str | None = None
    admin_token_file: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def connect(self, *, create: bool = False) -> AdminApi:
        """The database (`--db`, or the default one) or, with --coordinator, its admin service; a missing or
        unreadable token file, TLS files that do not go together, or both ways at once: one line, exit 2."""
        remote = (self.admin_token_file, self.tls_ca, self.tls_cert, self.tls_key)
        if self.coordinator is None:
            import getpass

            from hydrafl.server.administration import Administration
            from hydrafl.server.paths import data_dir

            if any(option is not None for option in remote):
                fail_one_line("--admin-token-file and --tls-* go with --coordinator", 2)
            store = open_store(self.db, create=create)
            runs = self.runs or data_dir() / "runs"
            return Administration(store, runs, f"local {getpass.getuser()}")
        if self.db is not None or self.runs is not None:
            fail_one_line(
                "--coordinator administers over the network: --db and --runs are for this machine's "
                "database",
                2,
            )
        from hydrafl.client.tls import SiteTls
        from hydrafl.validation import ConfigError

        try:
            tls = SiteTls.from_options(self.tls_ca, self.tls_cert, self.tls_key)
        except ConfigError as error:
            fail_one_line(str(error), 2)
        return RemoteAdministration(self.coordinator, self._token(), tls)

    def _token(self) -> str:
        if self.admin_token_file is None:
            fail_one_line(
                "--coordinator needs --admin-token-file (`hydrafl admin token create`)", 2
            )
        try:
            token = self.admin_token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            fail_one_line(f"cannot read --admin-token-file {self.admin_token_file}: {error}", 2)
        if not token:
            fail_one_line(f"--admin-token-file {self.admin_token_file} is empty", 2)
        return token


class Connect(Protocol):
    """Opens where a command acts when it is ready to act: a command that refuses its input opens nothing, and
    one that writes (`create`) may create the default database."""

    def __call__(self, *, create: bool = False) -> AdminApi: ...


def administered(*, runs: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the options that say where it acts (--db, with `runs` also --runs; or --coordinator,
    --admin-token-file and the TLS files), and call it with `connect` in their place: each command is written
    once for both ways."""
    places = {
        "db": DbOption,
        **({"runs": RunsOption} if runs else {}),
        "coordinator": CoordinatorOption,
        "admin_token_file": AdminTokenFileOption,
        "tls_ca": AdminTlsCaOption,
        "tls_cert": AdminTlsCertOption,
        "tls_key": AdminTlsKeyOption,
    }

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own = inspect.signature(command, eval_str=True)
        options = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
            for name, kind in places.items()
        ]
        parameters = [p for name, p in own.parameters.items() if name != "connect"] + options

        @functools.wraps(command)
        def with_place(*args: Any, **kwargs: Any) -> None:
            place = Place(**{name: kwargs.pop(name) for name in places})
            command(*args, connect=place.connect, **kwargs)

        with_place.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
        with_place.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_place

    return decorate
