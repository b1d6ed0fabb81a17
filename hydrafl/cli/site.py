"""`hydrafl site`: join a coordinator as a hospital site, after settling everything it can check alone.

Its token, its own data, its policy file and its TLS files are checked before it connects, so a mistake is a
one-line error with exit code 2 here rather than a failed round at the coordinator.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from click.core import ParameterSource
from rich.markup import escape

from hydrafl.cli.common import console, fail, fail_one_line, setup_logging, warn

if TYPE_CHECKING:
    from flwr.clientapp import ClientApp

    from hydrafl.secagg import SiteIdentity


HYDRAFL_APP = "hydrafl.apps:client_app"


def site(
    ctx: typer.Context,
    coordinator: Annotated[str, typer.Option(help="Coordinator HOST:PORT.")] = "127.0.0.1:9091",
    token: Annotated[
        str,
        typer.Option(
            envvar="HYDRAFL_SITE_TOKEN",
            help="Enrolment token; prefer $HYDRAFL_SITE_TOKEN or --token-file.",
        ),
    ] = "",
    token_file: Annotated[
        Path | None,
        typer.Option(help="File holding the enrolment token (kept out of `ps`, unlike --token)."),
    ] = None,
    data: Annotated[
        Path | None, typer.Option(help="This site's CSV/JSONL file or image folder.")
    ] = None,
    label_column: Annotated[
        str, typer.Option(help="Label column of a CSV/JSONL --data file.")
    ] = "",
    policy: Annotated[
        Path | None, typer.Option(help="Site policy TOML: allowed runs, update clipping, noise.")
    ] = None,
    max_download_mb: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Largest message this site downloads (MB of arrays); default half its RAM, and the "
            "free disk space for one over --exchange-memory-mb.",
        ),
    ] = None,
    exchange_memory_mb: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Memory (MB) a download or upload may hold (default a quarter of its RAM); a larger "
            "model goes through a file in --state-dir/exchange (else a temporary folder), a few chunks "
            "in memory at a time.",
        ),
    ] = None,
    nproc: Annotated[
        int,
        typer.Option(
            min=1, help="Training processes (one per GPU, or CPU ranks): DDP, same delta."
        ),
    ] = 1,
    max_restarts: Annotated[
        int,
        typer.Option(
            min=0, help="With --nproc > 1: restart the training processes this often when one dies."
        ),
    ] = 0,
    nnodes: Annotated[
        int,
        typer.Option(
            min=1, help="Hosts this site trains on, --nproc processes each (torch elastic)."
        ),
    ] = 1,
    node_rank: Annotated[
        int,
        typer.Option(
            min=0,
            help="With --nnodes > 1: 0 on the host that talks to the coordinator, 1.. on the others "
            "(which need no token and only train).",
        ),
    ] = 0,
    rdzv: Annotated[
        str,
        typer.Option(
            help="With --nnodes > 1: HOST:PORT of the site's rendezvous, on the node-rank-0 host."
        ),
    ] = "",
    bf16: Annotated[bool, typer.Option("--bf16", help="Train under bfloat16 autocast.")] = False,
    stream_layers: Annotated[
        bool,
        typer.Option(
            "--stream-layers",
            help="Keep the model's transformer blocks in host memory (disk on CPU) and stream a window of "
            "them through the device: for a model whose weights and optimizer state do not fit.",
        ),
    ] = False,
    window: Annotated[
        int | None,
        typer.Option(min=1, help="With --stream-layers: blocks on the device at once (default 2)."),
    ] = None,
    memory_mb: Annotated[
        float,
        typer.Option(
            min=0,
            help="Training memory this site offers (MB); Hydra-nets are sized to fit. 0 = no limit.",
        ),
    ] = 0.0,
    tier: Annotated[
        str,
        typer.Option(
            help="Resource tier this site declares: small, medium or large (wins over the run's site-tiers)."
        ),
    ] = "",
    model_dir: Annotated[
        Path | None,
        typer.Option(
            help="Folder of local checkpoints a run may name as its model (none otherwise)."
        ),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Folder for what must outlive a restart (compression residuals); memory otherwise."
        ),
    ] = None,
    client_app: Annotated[
        str,
        typer.Option(
            "--app",
            help="ClientApp to run, as module:attribute, found from the working directory as "
            "`flower-supernode` finds it.",
        ),
    ] = HYDRAFL_APP,
    threads: Annotated[
        int,
        typer.Option(
            min=0,
            help="Torch threads this site trains with; 0: its share of this machine's cores among the "
            "hydrafl sites running on it (all of them for a site alone on its server).",
        ),
    ] = 0,
    node_config: Annotated[
        str,
        typer.Option(
            help="Your app's node config, in Flower's syntax and types: \"partition-id=0 num-partitions=2\".",
        ),
    ] = "",
    allow_app: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-app",
            help="SHA-256 of a Flower app bundle this site runs when a run ships it (as the policy's "
            "allowed-apps); repeatable.",
        ),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option(help="CA that signed the coordinator's certificate (PEM); enables TLS."),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="This site's certificate (PEM), for mutual TLS.")
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(help="This site's private key (PEM), for mutual TLS.")
    ] = None,
    secagg_identity: Annotated[
        Path | None,
        typer.Option(
            help="This site's secure-aggregation identity (JSON, from `hydrafl admin site add "
            "--consortium-key`); without it the site refuses --secagg runs."
        ),
    ] = None,
    dedup_key_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the consortium's deduplication secret (hex, e.g. `openssl rand -hex 32`), "
            "shared by the sites and never by the coordinator; without it the site refuses --dedup runs."
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also log every message and Flower's own messages (joining, rounds and run ends are always logged).",
        ),
    ] = False,
) -> None:
    """Join a coordinator as a hospital site (outbound connection only) and train when asked."""
    from hydrafl.netaddr import check_address
    from hydrafl.validation import ConfigError

    try:  # before the imports below (torch among them): a typo costs a second
        check_address("--coordinator", coordinator)
        _check_hosts(nnodes, node_rank, rdzv)
    except ConfigError as error:
        fail_one_line(str(error), 2)
    if node_rank > 0:
        setup_logging(verbose)
        _train_for_the_leader(rdzv, nnodes=nnodes, nproc=nproc, max_restarts=max_restarts)
        return
    app_node_config = _node_config(node_config)
    import grpc

    from hydrafl.client.agent import SiteAgent, SiteRefused, Unreachable
    from hydrafl.client.machine_share import MachineShare
    from hydrafl.client.site_policy import PolicyError, SitePolicy, load_policy
    from hydrafl.client.tls import SiteTls, plaintext_warning
    from hydrafl.site_config import SiteConfig

    setup_logging(verbose)
    site_token = _site_token(ctx.get_parameter_source("token"), token, token_file)
    if data is not None and not data.exists():
        fail(f"--data {data} does not exist", 2)
    try:
        site_config = SiteConfig(
            data_path=data,
            label_column=label_column if data else "",
            model_dir=model_dir,
            nproc=nproc,
            max_restarts=max_restarts,
            nnodes=nnodes,
            rdzv=rdzv,
            bf16=True if bf16 else None,
            stream_layers=True if stream_layers else None,
            window=window,
            memory_mb=memory_mb or None,
            tier=tier,
            state_dir=state_dir,
            dedup_key=_read_secret(dedup_key_file, "--dedup-key-file") if dedup_key_file else "",
        )
    except ConfigError as error:
        fail(escape(str(error)), 2)
    try:
        site_policy = load_policy(policy) if policy else SitePolicy()
        site_policy = dataclasses.replace(
            site_policy, allowed_apps=site_policy.allowed_apps + tuple(allow_app or ())
        )
    except PolicyError as error:
        fail(f"invalid site policy, not starting: {error}", 2)
    own_app = client_app != HYDRAFL_APP
    if data is not None:
        _check_own_data(data, label_column)
    elif not own_app:
        console.print("no --data: joining with a synthetic demo cohort of the run's task")
    try:
        tls = SiteTls.from_options(tls_ca, tls_cert, tls_key)
    except ConfigError as error:
        fail(escape(str(error)), 2)
    identity = _read_identity(secagg_identity) if secagg_identity else None
    warning = plaintext_warning(coordinator, tls)
    if warning:
        warn(warning)
    share = MachineShare(fixed=threads)
    agent = SiteAgent(
        coordinator,
        site_token,
        _load_app(client_app),
        {**site_config.to_node_config(), **app_node_config},
        demo=data
        is None,  # a site's share of the run's demo cohort, for hydrafl's app or one wrapping it
        policy=site_policy,
        tls=tls,
        max_download_bytes=max_download_mb * 1_000_000 if max_download_mb else None,
        secagg_identity=identity,
        threads=share.threads,
        apps_dir=state_dir / "apps" if state_dir else None,
        exchange_memory_bytes=None
        if exchange_memory_mb is None
        else exchange_memory_mb * 1_000_000,
        exchange_dir=_exchange_dir(state_dir) if state_dir else None,
    )
    try:
        agent.run()
    except SiteRefused as error:
        fail(f"the coordinator refused this site: {error}", 3)
    except Unreachable as error:
        fail_one_line(str(error), 2)
    except (
        grpc.RpcError
    ) as error:  # not a coordinator, or one that answers an error no retry will fix
        fail(f"{coordinator} answered {error.code().name}: {error.details()}", 1)
    except KeyboardInterrupt:
        pass
    finally:
        share.release()


def _exchange_dir(state_dir: Path) -> Path:
    """The site's folder for file-backed downloads and uploads, made now: a folder it cannot make fails here."""
    folder = state_dir / "exchange"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        fail(escape(f"cannot make {folder}: {error.strerror or error}"), 2)
    return folder


def _check_hosts(nnodes: int, node_rank: int, rdzv: str) -> None:
    from hydrafl.netaddr import check_address
    from hydrafl.validation import ConfigError

    if nnodes == 1:
        if node_rank or rdzv:
            raise ConfigError(
                "--node-rank and --rdzv are for a site on several hosts (--nnodes > 1)"
            )
        return
    if node_rank >= nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    if not rdzv:
        raise ConfigError(
            f"--nnodes {nnodes} needs --rdzv HOST:PORT, an address of the node-rank-0 host"
        )
    check_address("--rdzv", rdzv)


def _train_for_the_leader(rdzv: str, *, nnodes: int, nproc: int, max_restarts: int) -> None:
    """A host other than the leader: no coordinator, no token; it trains in every round the leader starts."""
    from functools import partial

    from hydrafl.kernels.distributed import run_round_on_this_host
    from hydrafl.kernels.multi_host import serve_training_host

    console.print(
        f"training for the site's leader at {escape(rdzv)}: {nproc} process(es) on this host, "
        f"{nnodes} hosts"
    )
    run_round = partial(
        run_round_on_this_host,
        nnodes=nnodes,
        nproc=nproc,
        endpoint=rdzv,
        max_restarts=max_restarts,
    )
    try:
        serve_training_host(rdzv, run_round)
    except KeyboardInterrupt:
        pass


def _site_token(source: ParameterSource | None, token: str, token_file: Path | None) -> str:
    """The enrolment token, from exactly one of --token-file, $HYDRAFL_SITE_TOKEN and --token. A token typed on
    the command line still works, with a warning: every user of the machine can read it in `ps`."""
    given = "--token" if source is ParameterSource.COMMANDLINE else "$HYDRAFL_SITE_TOKEN"
    if token_file is not None:
        if token:
            fail(f"give the token one way: --token-file or {given}, not both", 2)
        return _read_token(token_file)
    if not token:
        fail(
            "a site needs its token (printed by `hydrafl admin site add NAME`): --token-file FILE or "
            "$HYDRAFL_SITE_TOKEN",
            2,
        )
    if source is ParameterSource.COMMANDLINE:
        warn(
            "--token on the command line is visible to every user of this machine in `ps`; "
            "use --token-file or $HYDRAFL_SITE_TOKEN"
        )
    return token


def _read_identity(path: Path) -> SiteIdentity:
    """The identity file the admin issued; a torn or foreign file (its certificate not its own) fails here."""
    from hydrafl.secagg import SecAggError, SiteIdentity

    try:
        return SiteIdentity.from_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        fail(escape(f"cannot read --secagg-identity {path}: {error}"), 2)
    except SecAggError as error:
        fail(escape(f"--secagg-identity {path}: {error}"), 2)


def _read_token(path: Path) -> str:
    token = _read_secret(path, "--token-file")
    if not token:
        fail(
            escape(
                f"--token-file {path} is empty; put the token `hydrafl admin site add NAME` printed in it"
            ),
            2,
        )
    return token


def _read_secret(path: Path, flag: str) -> str:
    """A secret kept in a file (out of `ps`), stripped; unreadable is a one-line error."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as error:
        fail(escape(f"cannot read {flag} {path}: {error.strerror or error}"), 2)
    except UnicodeDecodeError:
        fail(escape(f"{flag} {path} is not a text file"), 2)


def _check_own_data(data: Path, label_column: str) -> None:
    """Load the site's data as training will, so a wrong file or --label-column stops the site now instead of
    failing the run once it has joined."""
    from hydrafl.data import DataError, load_cohort

    try:
        load_cohort(
            "",
            num_sites=1,
            partition="iid",
            data_path=data,
            label_column=label_column or None,
            samples_per_site=2,
        )
    except DataError as error:
        fail(escape(str(error)), 2)


def _load_app(reference: str) -> ClientApp:
    """The ClientApp object at module:attribute (`--app`), resolved as Flower resolves it (the working
    directory first on the path); a wrong reference is an error, not a traceback."""
    from flwr.clientapp import ClientApp
    from flwr.supercore.object_ref import load_app

    try:
        app_object = load_app(reference, ValueError)
    except (ImportError, AttributeError, ValueError) as error:
        fail(f"cannot load ClientApp {reference!r}: {error}", 2)
    if not isinstance(app_object, ClientApp):
        fail(f"{reference!r} is a {type(app_object).__name__}, not a flwr ClientApp", 2)
    return app_object


def _node_config(text: str) -> dict[str, bool | int | float | str]:
    """`--node-config` parsed by Flower's own parser, so values have the types `flower-supernode` gives."""
    if not text:
        return {}
    from flwr.common.config import parse_config_args

    try:
        return dict(parse_config_args([text]))
    except (ValueError, TypeError) as error:
        fail(f"--node-config {text!r}: {error}", 2)
