"""`hydrafl admin run export ID DIR` and `hydrafl simulate --export`: a run's final checkpoint written as a model
a hospital loads without hydrafl (`hydrafl.export`). Model code loads only when a command exports."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hydrafl.cli.common import fail_one_line

if TYPE_CHECKING:
    from hydrafl.export import Exported

LOADS = {
    "transformers": "AutoModelFor<Task>.from_pretrained('{path}')",
    "peft": "PeftModel.from_pretrained(AutoModelFor<Task>.from_pretrained('{path}/base'), "
    "'{path}/adapter')",
    "safetensors": "safetensors.torch.load_file('{path}/model.safetensors') + '{path}/architecture.json'",
}
"""How each kind of export loads, as the command tells its user."""


def export_run(run_dir: Path, out: Path, data: str = "") -> Exported:
    """The final model of the run whose checkpoint is in `run_dir`, written to `out`."""
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


def describe(exported: Exported) -> str:
    """One line: where the model went and the call that loads it."""
    return f"{exported.kind} model in {exported.path}: {LOADS[exported.kind].format(path=exported.path)}"


def run_export(
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    out: Annotated[Path, typer.Argument(help="Folder to write the model to.")],
    data: Annotated[
        str,
        typer.Option(
            help="A sample of the sites' data, for a run whose sites read their own files (the model's "
            "classes and vocabulary come from it)."
        ),
    ] = "",
    runs: Annotated[
        Path | None, typer.Option("--runs", help="Run folders (default: $HYDRAFL_HOME/runs).")
    ] = None,
) -> None:
    """Write run ID's final model to DIR as a Hugging Face `save_pretrained` folder, a PEFT adapter beside its
    base model (LoRA runs), or safetensors with its architecture (hydrafl's small models)."""
    from hydrafl.export import ExportError
    from hydrafl.server.paths import data_dir

    run_dir = (runs or data_dir() / "runs") / str(run_id)
    try:
        exported = export_run(run_dir, out, data)
    except (ExportError, FileNotFoundError, ValueError) as error:
        fail_one_line(f"run {run_id}: {error}", 2)
    print(describe(exported))
