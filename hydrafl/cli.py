"""The `hydrafl` command."""

from __future__ import annotations

import json
import logging
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from click.core import ParameterSource
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

import hydrafl  # noqa: F401  (sets the telemetry/offline environment before Flower is imported)
from hydrafl.checkpoint import CheckpointError
from hydrafl.config import SITE_TIERS, ConfigError, build_simulation_config, load_toml
from hydrafl.data import DataError
from hydrafl.driver import RoundFailed
from hydrafl.netaddr import is_loopback
from hydrafl.stability import OuterSetup, check, plot_stable_region

if TYPE_CHECKING:
    from hydrafl.server.store import AuditEvent

app = typer.Typer(
    help="hydrafl: federated fine-tuning for hospital consortia.", no_args_is_help=True, pretty_exceptions_show_locals=False
)
console = Console(stderr=True)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    flower = logging.getLogger("flwr")
    flower.setLevel(logging.INFO if verbose else logging.WARNING)
    flower.propagate = False  # Flower has its own console handler


def _fail(message: str, code: int) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@app.command()
def simulate(
    config: Annotated[Path | None, typer.Option(help="TOML file; keys are these flags' names.")] = None,
    strategies: Annotated[str | None, typer.Option(help="Comma-separated, e.g. fedavg,fedprox,fedadam,diloco.")] = None,
    sites: Annotated[int | None, typer.Option(help="Number of simulated hospital sites.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Federated rounds per strategy.")] = None,
    local_steps: Annotated[int | None, typer.Option(help="Optimizer steps per site per round.")] = None,
    seed: Annotated[int | None, typer.Option(help="Same seed, same numbers.")] = None,
    out: Annotated[str | None, typer.Option(help="Output directory.")] = None,
    task: Annotated[str | None, typer.Option(help="clinical-text, chest-xray, tabular or clinical-notes-lm.")] = None,
    partition: Annotated[str | None, typer.Option(help="natural, iid, dirichlet:ALPHA or pathological:K.")] = None,
    backend: Annotated[str | None, typer.Option(help="inprocess (default) or ray (needs hydrafl[ray]).")] = None,
    resume: Annotated[bool | None, typer.Option("--resume", help="Continue each strategy from its checkpoint.")] = None,
    data: Annotated[str | None, typer.Option(help="CSV/JSONL file or image folder to split across sites.")] = None,
    label_column: Annotated[str | None, typer.Option(help="Label column of a CSV/JSONL --data file.")] = None,
    model: Annotated[str | None, typer.Option(help="'tiny', 'minilm' (pretrained) or a local checkpoint directory.")] = None,
    lora_rank: Annotated[int | None, typer.Option(help="PEFT LoRA rank (0 = full fine-tuning).")] = None,
    lora_alpha: Annotated[float | None, typer.Option(help="LoRA alpha (scaling alpha / rank).")] = None,
    lora_targets: Annotated[str | None, typer.Option(help="LoRA module suffixes, e.g. query,value (default q/k/v/o).")] = None,
    hetlora_prune: Annotated[float | None, typer.Option(help="HetLoRA: rank fraction a site self-prunes.")] = None,
    hetlora_tail_penalty: Annotated[
        float | None, typer.Option(help="HetLoRA: lambda of the sites' penalty on that rank tail (0 = none).")
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Inner (site) learning rate.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Site batch size.")] = None,
    inner_optimizer: Annotated[str | None, typer.Option(help="adamw, sgd, muon, or lm-dual (head-only Levenberg-Marquardt).")] = None,
    outer_lr: Annotated[float | None, typer.Option(help="DiLoCo outer learning rate.")] = None,
    outer_momentum: Annotated[float | None, typer.Option(help="DiLoCo outer momentum.")] = None,
    min_sites: Annotated[int | None, typer.Option(help="Fewer successful sites fail the round (0 = all).")] = None,
    samples_per_site: Annotated[int | None, typer.Option(help="Synthetic cohort size per site.")] = None,
    site_tiers: Annotated[str | None, typer.Option(help="Hydra: tier per site, e.g. small,medium,large.")] = None,
    site_memory_mb: Annotated[
        str | None, typer.Option(help="Hydra: training memory (MB) each site declares, e.g. 40,80,0 (0 = no limit).")
    ] = None,
    site_speeds: Annotated[
        str | None, typer.Option(help="Hydra: relative speed per site, e.g. 0.25,0.5,1 (with --round-timeout-s).")
    ] = None,
    round_timeout_s: Annotated[
        float | None, typer.Option(help="Round deadline (s); Hydra sizes each site's net so its steps fit it.")
    ] = None,
    hydra_layers: Annotated[float | None, typer.Option(help="Hydra: layer fraction of an untiered site.")] = None,
    hydra_heads: Annotated[float | None, typer.Option(help="Hydra: head fraction of an untiered site.")] = None,
    hydra_bypass: Annotated[
        bool | None, typer.Option("--hydra-bypass", help="Hydra: sites skip the layers outside their net (not frozen).")
    ] = None,
    hydra_head_mode: Annotated[
        str | None, typer.Option(help="Hydra: heads outside a site's net are dropped (masked) or frozen (run untrained).")
    ] = None,
    hydra_lora: Annotated[
        str | None, typer.Option(help="Hydra over LoRA: average the products B A (products) or A and B apart (factors).")
    ] = None,
    rescore_every: Annotated[int | None, typer.Option(help="Hydra: rescore every N rounds (0 = once).")] = None,
    layer_score: Annotated[str | None, typer.Option(help="Hydra: layer importance, fisher or taylor.")] = None,
    head_score: Annotated[str | None, typer.Option(help="Hydra: head importance, taylor (gate gradient) or confidence.")] = None,
    score_samples: Annotated[int | None, typer.Option(help="Hydra: samples a site scores on.")] = None,
    outer: Annotated[str | None, typer.Option(help="Hydra outer optimizer: none or nesterov.")] = None,
    nproc: Annotated[int | None, typer.Option(help="Training processes per simulated site (DDP; 1 = in process).")] = None,
    bf16: Annotated[bool | None, typer.Option("--bf16", help="Train under bfloat16 autocast.")] = None,
    distill_teacher: Annotated[
        str | None, typer.Option(help="Next-token task: distil from 'init' (frozen initial model) or a checkpoint dir.")
    ] = None,
    distill_weight: Annotated[float | None, typer.Option(help="Weight w of the loss CE + w * KL(teacher || student).")] = None,
    diagnostics: Annotated[
        bool | None, typer.Option("--diagnostics", help="Per round: B_pg and cosine to a full-data delta (costs a run).")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every round.")] = False,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Compare strategies on simulated non-IID hospital sites; writes results.json, report.md, PNGs, rounds.tsv."""
    flags = {name: value for name, value in locals().items() if value is not None}
    for name in ("config", "verbose", "progress"):
        flags.pop(name, None)
    from hydrafl.simulation.compare import compare_strategies
    from hydrafl.simulation.report import SUMMARY_COLUMNS, summary_rows

    _setup_logging(verbose)
    try:
        values: dict[str, Any] = load_toml(config) if config else {}
        values = {**values, **{name.replace("_", "-"): value for name, value in flags.items()}}
        simulation = build_simulation_config(values, source=str(config) if config else "options")
        results = compare_strategies(simulation, show_progress=progress)
    except (ConfigError, DataError, CheckpointError) as error:
        _fail(str(error), 2)
    except RoundFailed as error:
        _fail(str(error), 1)
    table = Table(title=f"hydrafl simulate -> {simulation.out}")
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in summary_rows(results):
        table.add_row(*row)
    Console().print(table)


@app.command()
def stability(
    inner_lr: Annotated[float, typer.Option(help="Inner SGD learning rate eta.")],
    curvature: Annotated[float, typer.Option(help="Curvature h of the mode.")],
    curvature_var: Annotated[float, typer.Option(help="Per-sample curvature variance v (2h^2 for Gaussian).")],
    batch_size: Annotated[int, typer.Option(help="Inner batch size b.")],
    local_steps: Annotated[int, typer.Option(help="Inner steps H per round.")],
    sites: Annotated[int, typer.Option(help="Number of sites M averaged.")],
    outer_lr: Annotated[float, typer.Option(help="Outer learning rate gamma.")],
    momentum: Annotated[float, typer.Option(help="Outer momentum mu.")],
    nesterov: Annotated[bool, typer.Option("--nesterov/--heavy-ball", help="Outer momentum form.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the stable region here.")] = None,
) -> None:
    """Exact mean-square stability of DiLoCo's outer momentum on the stochastic quadratic model."""
    try:
        setup = OuterSetup(
            inner_lr=inner_lr,
            curvature=curvature,
            curvature_var=curvature_var,
            batch_size=batch_size,
            local_steps=local_steps,
            sites=sites,
            outer_lr=outer_lr,
            momentum=momentum,
            nesterov=nesterov,
        )
    except ValueError as error:
        _fail(str(error), 2)
    verdict = check(setup)
    if plot:
        plot_stable_region(setup, plot)
    if as_json:
        print(json.dumps(verdict.to_dict()))
        return
    form = "Nesterov" if nesterov else "heavy-ball"
    word = "[green]STABLE[/]" if verdict.stable else "[red]UNSTABLE[/]"
    Console().print(
        f"{word} ({form}, mean-square): outer lr {outer_lr:g}, momentum {momentum:g}; "
        f"largest stable outer lr {verdict.max_stable_outer_lr:.4g}"
    )
    if plot:
        Console().print(f"stable region plotted to {plot}")


admin_app = typer.Typer(help="Administer a coordinator's database: sites (and runs).", no_args_is_help=True)
site_admin = typer.Typer(help="Enrol, list and revoke hospital sites.", no_args_is_help=True)
admin_app.add_typer(site_admin, name="site")
app.add_typer(admin_app, name="admin")
DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL (default: SQLite in $HYDRAFL_HOME).")]


def _store(db: str | None):  # noqa: ANN202  (the server package is imported only by admin commands)
    from hydrafl.server.paths import data_dir, default_db_url
    from hydrafl.server.store import Store

    if db is None:
        data_dir().mkdir(parents=True, exist_ok=True)
    return Store(db or default_db_url())


@site_admin.command("add")
def site_add(name: Annotated[str, typer.Argument(help="Site name, e.g. st-marys.")], db: DbOption = None) -> None:
    """Enrol a site and print its one-time token (only a hash is stored: copy it now)."""
    try:
        site, token = _store(db).add_site(name)
    except ValueError as error:
        _fail(str(error), 2)
    console.print(f"enrolled [bold]{site.name}[/] as node {site.node_id}; its token (shown once):")
    print(token)


@site_admin.command("list")
def site_list(db: DbOption = None) -> None:
    """List enrolled sites."""
    table = Table("site", "node id", "status", "enrolled")
    for site in _store(db).sites():
        table.add_row(site.name, str(site.node_id), "revoked" if site.revoked else "active", f"{site.created_at:%Y-%m-%d %H:%M}")
    Console().print(table)


@site_admin.command("revoke")
def site_revoke(name: Annotated[str, typer.Argument(help="Site name.")], db: DbOption = None) -> None:
    """Revoke a site: its token is refused from now on."""
    try:
        _store(db).revoke_site(name)
    except ValueError as error:
        _fail(str(error), 2)
    console.print(f"revoked [bold]{name}[/]")


run_admin = typer.Typer(help="Create runs and follow them.", no_args_is_help=True)
admin_app.add_typer(run_admin, name="run")


@run_admin.command("create")
def run_create(
    config: Annotated[Path | None, typer.Option(help="TOML file with run keys (task, strategy, rounds, ...).")] = None,
    strategy: Annotated[str | None, typer.Option(help="Strategy name, e.g. fedavg or diloco.")] = None,
    task: Annotated[str | None, typer.Option(help="Task (demo sites use its synthetic cohort).")] = None,
    rounds: Annotated[int | None, typer.Option(help="Federated rounds.")] = None,
    sites: Annotated[int | None, typer.Option(help="Sites expected (the demo cohort's size).")] = None,
    min_sites: Annotated[int | None, typer.Option(help="Fewer successful sites fail the round (0 = all).")] = None,
    local_steps: Annotated[int | None, typer.Option(help="Optimizer steps per site per round.")] = None,
    round_timeout_s: Annotated[float | None, typer.Option(help="Round deadline in seconds (0 = wait for all).")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed.")] = None,
    db: DbOption = None,
) -> None:
    """Queue a run; the coordinator starts it when enough sites are connected."""
    flags = {k: v for k, v in locals().items() if v is not None and k not in ("config", "db")}
    from hydrafl.config import RunConfig

    try:
        values = {**(load_toml(config) if config else {}), **flags}
        run_config = RunConfig.from_flower({key.replace("_", "-"): value for key, value in values.items()})
        unknown = sorted(set(k.replace("_", "-") for k in values) - set(run_config.to_flower()))
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(run_config.to_flower()))}")
    except (ConfigError, TypeError) as error:
        _fail(str(error), 2)
    stored = {k: v for k, v in run_config.to_flower().items() if k not in ("run-dir", "resume")}
    run = _store(db).create_run(stored)
    console.print(f"created run {run.id} ({run_config.strategy}, {run_config.rounds} rounds, task {run_config.task})")
    print(run.id)


@run_admin.command("status")
def run_status(
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    db: DbOption = None,
) -> None:
    """A run's state, rounds done, per-round metrics and the sites that declined or failed its messages."""
    store = _store(db)
    try:
        run = store.run(run_id)
    except ValueError as error:
        _fail(str(error), 2)
    declines = [_decline(event) for event in store.run_events(run_id, DECLINE_KINDS)]
    summary = {
        "run": run.id,
        "status": run.status,
        "rounds_done": run.rounds_done,
        "rounds": run.config.get("rounds"),
        "strategy": run.config.get("strategy"),
        "detail": run.detail,
        "history": run.history,
        "declines": declines,
    }
    if as_json:
        print(json.dumps(summary))
        return
    Console().print(f"run {run.id}: {run.status}, {run.rounds_done}/{summary['rounds']} rounds ({summary['strategy']})")
    table = Table("round", "loss", "accuracy", "sites ok", "bytes up", "seconds")
    for record in run.history:
        table.add_row(
            str(record["round"]), f"{record['loss'] or 0:.4f}", f"{record['accuracy'] or 0:.4f}",
            str(record["sites_ok"]), str(record["bytes_up"]), f"{record['seconds']:.2f}",
        )
    Console().print(table)
    if declines:
        _print_declines(declines)


DECLINE_KINDS = ("site-declined",)
SHOWN_DECLINES = 20
ROUND_PREFIX = re.compile(r"round (\d+)\s*(.*)", re.DOTALL)


def _decline(event: AuditEvent) -> dict:
    """A site-declined audit event as site, round (when its detail starts with "round N") and reason."""
    parsed = ROUND_PREFIX.fullmatch(event.detail)
    return {
        "site": event.site_name,
        "round": int(parsed.group(1)) if parsed else None,
        "reason": parsed.group(2) if parsed else event.detail,
        "at": f"{event.at:%Y-%m-%d %H:%M:%S}",
    }


def _print_declines(declines: list[dict]) -> None:
    shown = declines[-SHOWN_DECLINES:]
    earlier = f", the last {len(shown)} of {len(declines)}" if len(declines) > len(shown) else ""
    table = Table("site", "round", "reason")
    for decline in shown:
        round_text = "" if decline["round"] is None else str(decline["round"])
        table.add_row(escape(decline["site"]), round_text, escape(decline["reason"]))
    Console().print(f"sites that declined or failed{earlier}:")
    Console().print(table)


@run_admin.command("list")
def run_list(db: DbOption = None) -> None:
    """All runs."""
    table = Table("run", "strategy", "task", "status", "rounds", "created")
    for run in _store(db).runs():
        table.add_row(
            str(run.id), str(run.config.get("strategy")), str(run.config.get("task")), run.status,
            f"{run.rounds_done}/{run.config.get('rounds')}", f"{run.created_at:%Y-%m-%d %H:%M}",
        )
    Console().print(table)


SERVER_KEYS = {"listen", "db", "blobs", "tls-cert", "tls-key", "tls-client-ca", "lease-stale-s"}


def _fail_one_line(message: str, code: int) -> None:
    """Not wrapped at the terminal's width: scripts and log collectors get the whole reason on one line."""
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (docker stop, systemd) stops the coordinator as Ctrl-C does: it releases its database lease."""
    raise KeyboardInterrupt


@app.command()
def server(
    config: Annotated[Path | None, typer.Option(help="TOML file with these options' names as keys.")] = None,
    listen: Annotated[str | None, typer.Option(help="HOST:PORT to serve on (default 127.0.0.1:9091).")] = None,
    db: DbOption = None,
    blobs: Annotated[Path | None, typer.Option(help="Folder for array chunks (default: $HYDRAFL_HOME/blobs).")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Server certificate (PEM); enables TLS.")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Server private key (PEM).")] = None,
    tls_client_ca: Annotated[Path | None, typer.Option(help="CA of site certificates (PEM); enables mutual TLS.")] = None,
    lease_stale_s: Annotated[
        float | None,
        typer.Option(help="Seconds without a heartbeat after which another coordinator may take over (default 30)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every round.")] = False,
) -> None:
    """Run the coordinator: serves sites over gRPC and drives queued runs."""
    flags = {k.replace("_", "-"): v for k, v in locals().items() if v is not None and k not in ("config", "verbose")}
    from hydrafl.server.coordinator import LEASE_STALE_S, Coordinator, LeaseLost, ServerTls, plaintext_warning
    from hydrafl.server.paths import data_dir, default_blob_dir, default_db_url
    from hydrafl.server.store import LeaseHeld

    _setup_logging(verbose)
    try:
        values = {**(load_toml(config) if config else {}), **flags}
    except ConfigError as error:
        _fail(str(error), 2)
    unknown = sorted(set(values) - SERVER_KEYS)
    if unknown:
        _fail(f"unknown key {unknown[0]!r} in {config}; valid keys: {', '.join(sorted(SERVER_KEYS))}", 2)
    tls = None
    if values.get("tls-cert") or values.get("tls-key"):
        if not (values.get("tls-cert") and values.get("tls-key")):
            _fail("TLS needs both --tls-cert and --tls-key", 2)
        client_ca = values.get("tls-client-ca")
        tls = ServerTls(cert=Path(values["tls-cert"]), key=Path(values["tls-key"]),
                        client_ca=Path(client_ca) if client_ca else None)
    elif values.get("tls-client-ca"):
        _fail("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key", 2)
    data_dir().mkdir(parents=True, exist_ok=True)
    listen_on = values.get("listen", "127.0.0.1:9091")
    db_url = values.get("db") or default_db_url()
    blob_dir = Path(values.get("blobs") or default_blob_dir())
    stale_s = values.get("lease-stale-s", LEASE_STALE_S)
    if not isinstance(stale_s, int | float) or stale_s <= 0:
        _fail(f"lease-stale-s must be a positive number of seconds, got {stale_s!r}", 2)
    try:
        coordinator = Coordinator(
            listen=listen_on, db_url=db_url, blob_dir=blob_dir, runs_dir=data_dir() / "runs", tls=tls,
            lease_stale_s=float(stale_s),
        )
        coordinator.start()
    except (OSError, LeaseHeld) as error:
        _fail_one_line(str(error), 2)
    signal.signal(signal.SIGTERM, _interrupt)
    mode = "no TLS" if tls is None else ("mutual TLS" if tls.client_ca else "TLS")
    if plaintext_warning(listen_on, tls):
        mode = "[bold yellow]NO TLS, reachable from the network[/]"
    console.print(
        f"coordinator on {escape(listen_on)} ({mode}); database {escape(db_url)}; blobs {blob_dir}; "
        f"runs {data_dir() / 'runs'}"
    )
    try:
        coordinator.serve_forever()
    except KeyboardInterrupt:
        pass
    except LeaseLost as error:
        _fail_one_line(str(error), 1)
    finally:
        coordinator.stop()


@app.command()
def site(
    ctx: typer.Context,
    coordinator: Annotated[str, typer.Option(help="Coordinator HOST:PORT.")] = "127.0.0.1:9091",
    token: Annotated[
        str, typer.Option(envvar="HYDRAFL_SITE_TOKEN", help="Enrolment token; prefer $HYDRAFL_SITE_TOKEN or --token-file.")
    ] = "",
    token_file: Annotated[
        Path | None, typer.Option(help="File holding the enrolment token (kept out of `ps`, unlike --token).")
    ] = None,
    data: Annotated[Path | None, typer.Option(help="This site's CSV/JSONL file or image folder.")] = None,
    label_column: Annotated[str, typer.Option(help="Label column of a CSV/JSONL --data file.")] = "",
    policy: Annotated[Path | None, typer.Option(help="Site policy TOML: allowed runs, update clipping, noise.")] = None,
    max_download_mb: Annotated[
        int | None, typer.Option(min=1, help="Largest message this site downloads (MB of arrays); default half its RAM.")
    ] = None,
    nproc: Annotated[int, typer.Option(min=1, help="Training processes (one per GPU, or CPU ranks): DDP, same delta.")] = 1,
    max_restarts: Annotated[
        int, typer.Option(min=0, help="With --nproc > 1: restart the training processes this often when one dies.")
    ] = 0,
    bf16: Annotated[bool, typer.Option("--bf16", help="Train under bfloat16 autocast.")] = False,
    memory_mb: Annotated[
        float, typer.Option(min=0, help="Training memory this site offers (MB); Hydra-nets are sized to fit. 0 = no limit.")
    ] = 0.0,
    tier: Annotated[
        str, typer.Option(help="Resource tier this site declares: small, medium or large (wins over the run's site-tiers).")
    ] = "",
    model_dir: Annotated[
        Path | None, typer.Option(help="Folder of local checkpoints a run may name as its model (none otherwise).")
    ] = None,
    client_app: Annotated[str, typer.Option("--app", help="ClientApp to run, as module:attribute.")] = "hydrafl.apps:client_app",
    tls_ca: Annotated[Path | None, typer.Option(help="CA that signed the coordinator's certificate (PEM); enables TLS.")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="This site's certificate (PEM), for mutual TLS.")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="This site's private key (PEM), for mutual TLS.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every message.")] = False,
) -> None:
    """Join a coordinator as a hospital site (outbound connection only) and train when asked."""
    import grpc

    from hydrafl.client.agent import SiteAgent, SiteRefused, SiteTls
    from hydrafl.client.policy import PolicyError, SitePolicy, load_policy

    _setup_logging(verbose)
    site_token = _site_token(ctx.get_parameter_source("token"), token, token_file)
    if data is not None and not data.exists():
        _fail(f"--data {data} does not exist", 2)
    if tier and tier not in SITE_TIERS:
        _fail(f"--tier {tier!r}: choose one of {', '.join(SITE_TIERS)}", 2)
    try:
        site_policy = load_policy(policy) if policy else SitePolicy()
    except PolicyError as error:
        _fail(f"invalid site policy, not starting: {error}", 2)
    if data is not None:
        _check_own_data(data, label_column)
    node_config = {"data-path": str(data), "label-column": label_column} if data else {}
    node_config["nproc"] = nproc
    if max_restarts:
        node_config["max-restarts"] = max_restarts
    if memory_mb:
        node_config["memory-mb"] = memory_mb
    if tier:
        node_config["tier"] = tier
    if bf16:
        node_config["bf16"] = True
    if model_dir is not None:
        node_config["model-dir"] = str(model_dir)
    if data is None:
        console.print("no --data: joining with a synthetic demo cohort of the run's task")
    if (tls_cert is None) != (tls_key is None) or (tls_cert and tls_ca is None):
        _fail("mutual TLS needs --tls-ca, --tls-cert and --tls-key together", 2)
    tls = SiteTls(ca=tls_ca, cert=tls_cert, key=tls_key) if tls_ca else None
    if tls is None and not is_loopback(coordinator):
        _warn(
            f"connecting to {coordinator} without TLS: the token and every update cross the network in clear text "
            "and the coordinator is not authenticated; pass --tls-ca with the CA of the coordinator's certificate"
        )
    agent = SiteAgent(
        coordinator, site_token, _load_app(client_app), node_config, demo=data is None, policy=site_policy, tls=tls,
        max_download_bytes=max_download_mb * 1_000_000 if max_download_mb else None,
    )
    try:
        agent.run()
    except SiteRefused as error:
        _fail(f"the coordinator refused this site: {error}", 3)
    except grpc.RpcError as error:  # not a coordinator, or one that answers an error no retry will fix
        _fail(f"{coordinator} answered {error.code().name}: {error.details()}", 1)
    except KeyboardInterrupt:
        pass


def _warn(message: str) -> None:
    console.print(f"[bold yellow]warning:[/] {escape(message)}")


def _site_token(source: ParameterSource | None, token: str, token_file: Path | None) -> str:
    """The enrolment token, from exactly one of --token-file, $HYDRAFL_SITE_TOKEN and --token. A token typed on
    the command line still works, with a warning: every user of the machine can read it in `ps`."""
    given = "--token" if source is ParameterSource.COMMANDLINE else "$HYDRAFL_SITE_TOKEN"
    if token_file is not None:
        if token:
            _fail(f"give the token one way: --token-file or {given}, not both", 2)
        return _read_token(token_file)
    if not token:
        _fail("a site needs its token (printed by `hydrafl admin site add NAME`): --token-file FILE or "
              "$HYDRAFL_SITE_TOKEN", 2)
    if source is ParameterSource.COMMANDLINE:
        _warn("--token on the command line is visible to every user of this machine in `ps`; "
              "use --token-file or $HYDRAFL_SITE_TOKEN")
    return token


def _read_token(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        _fail(escape(f"cannot read --token-file {path}: {error.strerror or error}"), 2)
    except UnicodeDecodeError:
        _fail(escape(f"--token-file {path} is not a text file"), 2)
    if not token:
        _fail(escape(f"--token-file {path} is empty; put the token `hydrafl admin site add NAME` printed in it"), 2)
    return token


def _check_own_data(data: Path, label_column: str) -> None:
    """Load the site's data as training will, so a wrong file or --label-column stops the site now instead of
    failing the run once it has joined."""
    from hydrafl.data import load_cohort

    try:
        load_cohort(
            "", num_sites=1, partition="iid", data_path=data, label_column=label_column or None, samples_per_site=2
        )
    except DataError as error:
        _fail(escape(str(error)), 2)


def _load_app(reference: str):  # noqa: ANN202
    import importlib

    from flwr.clientapp import ClientApp

    module_name, _, attribute = reference.partition(":")
    try:
        app_object = getattr(importlib.import_module(module_name), attribute or "app")
    except (ImportError, AttributeError) as error:
        _fail(f"cannot load ClientApp {reference!r}: {error}", 2)
    if not isinstance(app_object, ClientApp):
        _fail(f"{reference!r} is a {type(app_object).__name__}, not a flwr ClientApp", 2)
    return app_object


def main() -> None:
    app()
