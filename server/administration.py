"""What an administrator may do to a coordinator: enrol and revoke sites, queue runs, follow them, read their
logs, stop them, export their final model. One class for both ways in: `hydrafl admin ... --db` calls it on the
database directly, and the coordinator's admin service (`transport.admin_service`) calls it for `hydrafl admin
... --coordinator`, so every command is written once and behaves the same either way.

Every action is audited (kind `admin`, the actor and the action in its detail): a follower's repeated reads of a
run's log count once, when it starts reading. Results are plain JSON values, as they travel over the network.
A refusal is a ValueError whose message says what to do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydrafl.app_bundle import read_bundle
from hydrafl.bounded import bounded
from hydrafl.server.run_log_file import read_log
from hydrafl.server.store import Store
from hydrafl.server.tables import STOP_AT_ROUND_END, STOP_NOW, AuditEvent, Run
from hydrafl.trust import trust_summary

if TYPE_CHECKING:
    from hydrafl.export import Exported

MAX_SITE_NAME_CHARS = 128
"""The `sites.name` column's width."""
DECLINE_KINDS = ("site-declined",)
ROUND_PREFIX = re.compile(r"round (\d+)\s*(.*)", re.DOTALL)


class Administration:
    """A coordinator's store and run folders as an administrator acts on them; `actor` is who the audit names."""

    def __init__(self, store: Store, runs_dir: Path, actor: str) -> None:
        self.store = store
        self.runs_dir = runs_dir
        self.actor = actor

    def _audit(self, action: str, run_id: int | None = None) -> None:
        self.store.audit("admin", run_id=run_id, detail=f"{self.actor}: {action}")

    # --- sites ----------------------------------------------------------------------------------------------

    def sites(self) -> list[dict[str, Any]]:
        self._audit("site list")
        return [
            {
                "name": site.name,
                "node_id": site.node_id,
                "revoked": site.revoked,
                "created_at": f"{site.created_at:%Y-%m-%d %H:%M}",
            }
            for site in self.store.sites()
        ]

    def add_site(self, name: str) -> dict[str, Any]:
        """Enrol a site: its node id and one-time token (only a hash is stored)."""
        if not name.strip() or len(name) > MAX_SITE_NAME_CHARS:
            raise ValueError(f"a site name has 1 to {MAX_SITE_NAME_CHARS} characters")
        self._audit(f"site add {name}")
        site, token = self.store.add_site(name)
        return {"name": site.name, "node_id": site.node_id, "token": token}

    def revoke_site(self, name: str) -> dict[str, Any]:
        self._audit(f"site revoke {bounded(name, MAX_SITE_NAME_CHARS)}")
        self.store.revoke_site(name)
        return {}

    # --- runs -----------------------------------------------------------------------------------------------

    def create_run(
        self,
        config: dict[str, Any],
        server_app: str | None = None,
        app_bundle: bytes | None = None,
    ) -> dict[str, Any]:
        """Queue a run of these (already checked) run keys, or of a stock ServerApp with this run_config, from
        `app_bundle` (a Flower app bundle, checked here) when given."""
        what = server_app or config.get("strategy")
        if app_bundle:
            what = f"{server_app} from app bundle sha256:{read_bundle(app_bundle).digest}"
        run = self.store.create_run(config, server_app=server_app, app_bundle=app_bundle or None)
        self._audit(f"run create {what}", run.id)
        return {"id": run.id}

    def runs(self) -> list[dict[str, Any]]:
        self._audit("run list")
        return [_run_row(run) for run in self.store.runs()]

    def run_status(self, run_id: int) -> dict[str, Any]:
        """A run's state, rounds, per-round metrics, and the sites that declined or failed its messages."""
        run = self.store.run(run_id)
        self._audit("run status", run_id)
        return {
            "run": run.id,
            "status": run.status,
            "rounds_done": run.rounds_done,
            "rounds": run.total_rounds,
            "strategy": None if run.server_app else run.config.get("strategy"),
            "server_app": run.server_app,
            "run_config": run.config if run.server_app else None,
            "detail": run.detail,
            "history": run.history,
            "declines": [_decline(e) for e in self.store.run_events(run_id, DECLINE_KINDS)],
            "trust": trust_summary(run.history, {} if run.server_app else run.config),
        }

    def run_logs(self, run_id: int, offset: int = 0) -> dict[str, Any]:
        """The run's log lines from byte `offset` (`run_log_file`), where to read next, and the run's status (a
        follower stops once the run ended and nothing is left to read)."""
        status = self.store.run(run_id).status
        if offset == 0:
            self._audit("run logs", run_id)
        lines = read_log(self.runs_dir / str(run_id), offset)
        return {"lines": lines.lines, "offset": lines.offset, "status": status}

    def stop_run(self, run_id: int, now: bool = False) -> dict[str, Any]:
        """Stop a run at the end of its current round (its checkpoint written: it resumes from there), or with
        `now` at once (the round in progress is dropped; it resumes from the round before)."""
        self._audit(f"run stop{' --now' if now else ''}", run_id)
        return {"status": self.store.request_stop(run_id, STOP_NOW if now else STOP_AT_ROUND_END)}

    def resume_run(self, run_id: int) -> dict[str, Any]:
        """Queue a stopped run again; the coordinator continues it from its last checkpoint."""
        self._audit("run resume", run_id)
        self.store.resume_run(run_id)
        return {}

    def export(self, run_id: int, out: Path, data: str = "") -> str:
        """Write the run's final model to `out` (on this machine: the coordinator's, for the admin service);
        returns its kind (`hydrafl.export.Exported`)."""
        self.store.run(run_id)
        self._audit("run export", run_id)
        return export_run(self.runs_dir / str(run_id), out, data).kind


def export_run(run_dir: Path, out: Path, data: str = "") -> Exported:
    """The final model of the run whose checkpoint is in `run_dir`, written to `out` (model code loads now)."""
    from hydrafl.arrays import from_record
    from hydrafl.config import RunConfig
    from hydrafl.export import export_model, final_model, run_task
    from hydrafl.server.aggregation.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(run_dir)
    if checkpoint is None:
        raise FileNotFoundError(f"{run_dir} holds no checkpoint: the run has not finished a round")
    cfg = RunConfig.from_flower(checkpoint.run_config, source=str(run_dir), other_knobs=True)
    model = final_model(cfg, from_record(checkpoint.arrays), run_task(cfg, data))
    return export_model(model, cfg, out)


def _run_row(run: Run) -> dict[str, Any]:
    stock = run.server_app is not None
    return {
        "id": run.id,
        "strategy": run.server_app if stock else run.config.get("strategy"),
        "task": "-" if stock else run.config.get("task"),
        "status": run.status,
        "rounds_done": run.rounds_done,
        "rounds": run.total_rounds,
        "created_at": f"{run.created_at:%Y-%m-%d %H:%M}",
    }


def _decline(event: AuditEvent) -> dict[str, Any]:
    """A site-declined audit event as site, round (when its detail starts with "round N") and reason."""
    parsed = ROUND_PREFIX.fullmatch(event.detail)
    return {
        "site": event.site_name,
        "round": int(parsed.group(1)) if parsed else None,
        "reason": parsed.group(2) if parsed else event.detail,
        "at": f"{event.at:%Y-%m-%d %H:%M:%S}",
    }
