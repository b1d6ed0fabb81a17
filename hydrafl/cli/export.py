"""`hydrafl admin run export ID DIR` and `hydrafl simulate --export`: a run's final checkpoint written as a model
a hospital loads without hydrafl (`hydrafl.export`). Model code loads only when a command exports."""

from __future__ import annotations

from pathlib import Path

LOADS = {
    "transformers": "AutoModelFor<Task>.from_pretrained('{path}')",
    "peft": "PeftModel.from_pretrained(AutoModelFor<Task>.from_pretrained('{path}/base'), "
    "'{path}/adapter')",
    "safetensors": "safetensors.torch.load_file('{path}/model.safetensors') + '{path}/architecture.json'",
}
"""How each kind of export loads, as the command tells its user."""


def describe(kind: str, path: Path) -> str:
    """One line: where the model of this kind (`hydrafl.export.Exported`) went and the call that loads it."""
    return f"{kind} model in {path}: {LOADS[kind].format(path=path)}"
