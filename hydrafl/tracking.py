"""Runs followed where ML teams look: `--track tensorboard:DIR` or `--track mlflow:URI`.

One small interface (`Tracker`) that the simulation and the coordinator each call from one place, the callback
that sees every round's record: the run's configuration as parameters when it opens, each round's metrics (loss,
accuracy, bytes, seconds, epsilon, and per site its bytes, memory and local epsilon) as it ends, and the report
and plots as artifacts at the end. Data flows one way: hydrafl writes, TensorBoard or MLflow reads. The writers
are optional extras (`hydrafl[tensorboard]`, `hydrafl[mlflow]`), imported only when a run is tracked;
`TrackTarget.parse` checks the spelling and that the extra is installed before any work.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hydrafl.rounds import RoundRecord
from hydrafl.validation import ConfigError

TRACKERS = {"tensorboard": ("tensorboardX", "tensorboard"), "mlflow": ("mlflow", "mlflow")}
"""Per kind: the module that writes it, and the hydrafl extra that installs that module."""
log = logging.getLogger(__name__)

EXPERIMENT = "hydrafl"
"""The MLflow experiment every tracked run is filed under."""
MLFLOW_BATCH_PARAMS, MLFLOW_BATCH_METRICS = 100, 1000
"""The most parameters and metrics one MLflow `log_batch` call takes."""
ROUND_METRICS = (
    "loss",
    "accuracy",
    "train_loss",
    "bytes_up",
    "bytes_down",
    "seconds",
    "aggregation_s",
    "sites_ok",
    "sites_failed",
    "dp_epsilon",
)
"""A round record's run-wide numbers that are tracked, each under its own name (when measured)."""
SITE_METRICS = (
    "bytes_up_per_site",
    "bytes_down_per_site",
    "peak_memory_per_site",
    "local_epsilon_per_site",
)
"""Its per-site numbers, tracked as `site/NODE/NAME` with NAME the field less `_per_site`."""


def round_metrics(record: RoundRecord) -> dict[str, float]:
    """The numbers a tracker logs for one round, by name."""
    metrics = {
        name: float(value) for name in ROUND_METRICS if (value := getattr(record, name)) is not None
    }
    for field_name in SITE_METRICS:
        short = field_name.removesuffix("_per_site")
        for node, value in getattr(record, field_name).items():
            metrics[f"site/{node}/{short}"] = float(value)
    return metrics


class Tracker(Protocol):
    """Where one run's records go besides its own folder."""

    def log_round(self, record: RoundRecord) -> None: ...

    def log_artifacts(self, paths: Iterable[Path]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TrackTarget:
    """A parsed `--track KIND:WHERE`."""

    kind: str
    where: str

    @classmethod
    def parse(cls, spec: str, flag: str = "--track") -> TrackTarget:
        """`spec` checked: a known kind, somewhere to write, its extra installed; else a ConfigError that says
        what to install or write."""
        kind, _, where = spec.partition(":")
        if kind not in TRACKERS or not where:
            raise ConfigError(
                f"{flag} {spec!r}: expected tensorboard:DIR or mlflow:URI "
                "(e.g. tensorboard:tb-logs, mlflow:sqlite:///mlflow.db, mlflow:http://host:5000)"
            )
        module, extra = TRACKERS[kind]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"{flag} {kind} needs the {extra} extra: pip install 'hydrafl[{extra}]'"
            )
        return cls(kind, where)

    def open(self, run_name: str, params: Mapping[str, Any]) -> Tracker:
        """A tracker for one run called `run_name`, its configuration `params` already logged. One that cannot
        open (a tracking server down, a folder not writable) is a ConfigError that names it; once open, a
        failure to track warns once and the run goes on untracked (`Guarded`)."""
        try:
            if self.kind == "tensorboard":
                return Guarded(TensorBoardTracker(Path(self.where) / run_name, params))
            return Guarded(MlflowTracker(self.where, run_name, params))
        except (
            Exception
        ) as error:  # each library has its own errors; all of them mean the same here
            raise ConfigError(
                f"--track {self.kind}:{self.where}: cannot open it ({type(error).__name__}: {error})"
            ) from error


class Guarded:
    """A tracker whose failures cost the run nothing: the first one is logged, and tracking stops there."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker: Tracker | None = tracker

    def log_round(self, record: RoundRecord) -> None:
        self._call("log_round", record)

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        self._call("log_artifacts", list(paths))

    def close(self) -> None:
        self._call("close")

    def _call(self, method: str, *args: Any) -> None:
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as error:
            log.warning("tracking stopped: %s failed (%s: %s)", method, type(error).__name__, error)
            self.tracker = None


class TensorBoardTracker:
    """Event files in `logdir` (`tensorboard --logdir` its parent to compare runs): scalars per round, the
    configuration and the report as text, the plots as images."""

    def __init__(self, logdir: Path, params: Mapping[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(logdir))
        rows = "\n".join(f"| {key} | {value} |" for key, value in sorted(params.items()))
        self.writer.add_text("config", "| key | value |\n|---|---|\n" + rows, 0)

    def log_round(self, record: RoundRecord) -> None:
        for name, value in round_metrics(record).items():
            self.writer.add_scalar(name, value, record.round)
        self.writer.flush()

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        import numpy as np
        from PIL import Image

        for path in paths:
            if path.suffix == ".png":
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("RGB"))
                self.writer.add_image(path.stem, pixels, 0, dataformats="HWC")
            elif path.suffix in (".md", ".tsv", ".json"):
                self.writer.add_text(path.name, _as_markdown(path), 0)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """One MLflow run in the `hydrafl` experiment of the tracking store `uri` (a database such as
    sqlite:///mlflow.db, or a tracking server): parameters, metrics by step = round, files as artifacts.
    A new local database keeps its artifacts in `mlartifacts` beside it, not in the working directory."""

    def __init__(self, uri: str, run_name: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(EXPERIMENT, artifact_location=_artifacts_beside(uri))
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        logged = [Param(key, str(value)) for key, value in sorted(params.items())]
        for start in range(0, len(logged), MLFLOW_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=logged[start : start + MLFLOW_BATCH_PARAMS])

    def log_round(self, record: RoundRecord) -> None:
        from mlflow.entities import Metric

        metrics = [
            Metric(name, value, 0, record.round) for name, value in round_metrics(record).items()
        ]
        for start in range(0, len(metrics), MLFLOW_BATCH_METRICS):
            self.client.log_batch(
                self.run_id, metrics=metrics[start : start + MLFLOW_BATCH_METRICS]
            )

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _artifacts_beside(uri: str) -> str | None:
    """For a local SQLite store, a folder beside its file; elsewhere MLflow's own default."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri.removeprefix(prefix)).resolve().parent / "mlartifacts").as_uri()


def _as_markdown(path: Path) -> str:
    """A text file as TensorBoard's text tab shows it: Markdown as is, anything else as a code block."""
    text = path.read_text()
    if path.suffix == ".json":
        text = json.dumps(json.loads(text), indent=1)
    return text if path.suffix == ".md" else "```\n" + text + "\n```"
