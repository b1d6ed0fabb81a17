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
