"""Names a run may choose among (tasks, inner optimizers, site tiers), kept apart from the code behind them
so that configuration validates without importing the cohorts or the kernels."""

from __future__ import annotations

TASKS: tuple[str, ...] = ("clinical-text", "chest-xray", "tabular")
"""The classification tasks: one label per row."""
NEXT_TOKEN_TASKS: tuple[str, ...] = ("clinical-notes-lm",)
"""Causal-LM tasks: a next-token target per position (`TaskSpec.objective` "next-token")."""
INNER_OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd", "muon", "lm-dual")
"""What a site steps its model with (`hydrafl.kernels.optimizers`); lm-dual (Levenberg-Marquardt, dual form)
trains only the classification head (`kernels.lm_dual.HeadLM`)."""
SITE_TIERS: tuple[str, ...] = ("small", "medium", "large")
"""Resource tiers a site may declare; the subnetwork strategies size its share of the model by it."""
MOE_MODEL = "tiny-moe"
"""The seeded tiny mixture-of-experts LM (Mixtral family) a next-token task may name instead of "tiny"."""
IMAGE_TASKS: tuple[str, ...] = ("chest-xray",)
"""The synthetic image cohorts: their from-scratch model stays the tiny ViT."""
IMAGE_MODELS: tuple[str, ...] = ("vit", "cnn")
"""Seeded from-scratch image models a run may name: the tiny ViT and the small CNN (`hydrafl.models.SmallCNN`)."""
IMAGE_FOLDER_MODEL = "cnn"
"""What `model = "tiny"` builds for a user's image folder, chosen by measurement: against the tiny ViT on scanned
digits (0.97 after 8 fedavg rounds, the ViT from scratch 0.39), and its shape against wider and narrower ones on
real garment photos, handwriting and digits over non-IID sites (`benchmarks/image_models.py`)."""
TABLE_SUFFIXES: tuple[str, ...] = (".csv", ".jsonl", ".ndjson")
"""A `data` path with one of these suffixes is a table; any other names an image folder (`hydrafl.data.files`)."""


def from_scratch_model(task: str, modality: str) -> str:
    """The seeded model "tiny" stands for: the small CNN for an image folder (a non-synthetic image task), the
    tiny ViT for a synthetic image cohort, "tiny" (the task's tiny transformer) otherwise."""
    if modality != "image":
        return "tiny"
    return "vit" if task in IMAGE_TASKS else IMAGE_FOLDER_MODEL


def has_images(*, task: str, data: str) -> bool:
    """Whether a run's settings name images (an image folder: a `data` path that is no table; or a synthetic
    image cohort), known without opening any file."""
    return not data.lower().endswith(TABLE_SUFFIXES) if data else task in IMAGE_TASKS


def run_model(model: str, *, task: str, data: str) -> str:
    """What a run's `model` builds, known from its settings alone: "tiny" is the small CNN on an image folder
    and the tiny ViT on a synthetic image cohort (as `from_scratch_model` decides at the site)."""
    if model != "tiny" or not has_images(task=task, data=data):
        return model
    return IMAGE_FOLDER_MODEL if data else "vit"
