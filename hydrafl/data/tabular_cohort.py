"""Synthetic "tabular": emergency-department vitals and labs -> disposition (discharge / ward / ICU).

Patients come from a latent acuity and a latent infection burden; the disposition follows a fixed,
nonlinear ground truth with interactions (shock index, lactate weighted by age, hypoxia, fever with a
raised white count, kidney injury) plus noise, so no model can be perfect. Hospitals differ in who walks in
(age mix, case mix) and in how they measure (analyser calibration on labs, thermometer and oximeter
offsets, how often lactate is drawn at all), the two kinds of shift federated models have to survive.
"""

from __future__ import annotations

import numpy as np

from hydrafl.data.schema import TaskSpec
from hydrafl.data.sites import GENERATE_STREAM, sample_site_labels, site_rng

CLASS_NAMES = ("discharge", "ward", "icu")
FEATURES = (
    "age",
    "heart_rate",
    "systolic_bp",
    "resp_rate",
    "temperature",
    "spo2",
    "wbc",
    "lactate",
    "creatinine",
    "glucose",
    "sodium",
    "hemoglobin",
)
LABS = {
    "wbc": 2.5,
    "lactate": 0.6,
    "creatinine": 0.4,
    "glucose": 28.0,
}  # analyser-calibrated per site; typical SD
SEVERITY_CUTS = (1.4, 2.9)  # ward above the first, ICU above the second
NOISE_SCALE = 0.3  # logistic noise on the severity: the irreducible error of triage
_COL = {name: i for i, name in enumerate(FEATURES)}


def task_spec() -> TaskSpec:
    return TaskSpec(
        name="tabular",
        modality="tabular",
        num_classes=len(CLASS_NAMES),
        class_names=CLASS_NAMES,
        num_features=len(FEATURES),
    )


def _patients(rng: np.random.Generator, n: int, age_mean: float, age_sd: float) -> np.ndarray:
    """True (unshifted) measurements float64 [n, len(FEATURES)] for n patients of one population."""
    age = np.clip(rng.normal(age_mean, age_sd, n), 18.0, 100.0)
    acuity = rng.normal(0.012 * (age - 60.0), 1.0)
    infection = rng.normal(0.0, 1.0, n)

    def noise(sd: float) -> np.ndarray:
        return rng.normal(0.0, sd, n)

    columns = {
        "age": age,
        "heart_rate": 78.0 + 9.0 * acuity + 6.0 * infection + noise(9.0),
        "systolic_bp": 128.0
        + 0.3 * (age - 60.0)
        - 10.0 * np.maximum(acuity, 0.0)
        - 4.0 * infection
        + noise(14.0),
        "resp_rate": 16.0 + 2.5 * acuity + 1.0 * infection + noise(2.5),
        "temperature": 37.0 + 0.6 * infection + noise(0.4),
        "spo2": np.minimum(97.5 - 2.2 * np.maximum(acuity, 0.0) + noise(1.5), 100.0),
        "wbc": np.exp(np.log(8.0) + 0.25 * infection + 0.08 * acuity + noise(0.25)),
        "lactate": np.exp(np.log(1.3) + 0.3 * acuity + 0.1 * infection + noise(0.3)),
        "creatinine": np.exp(0.006 * (age - 60.0) + 0.18 * acuity + noise(0.3)),
        "glucose": 110.0 + 12.0 * acuity + noise(25.0),
        "sodium": 139.0 - 1.2 * acuity + noise(3.0),
        "hemoglobin": 13.5 - 0.02 * (age - 60.0) - 0.4 * acuity + noise(1.4),
    }
    return np.stack([columns[name] for name in FEATURES], axis=1)


def severity(x: np.ndarray) -> np.ndarray:
    """The ground-truth acuity score of true measurements; the disposition thresholds it (after noise)."""
    c = {name: x[:, i] for name, i in _COL.items()}
    shock_index = c["heart_rate"] / c["systolic_bp"]
    older = 1.0 + 0.03 * np.maximum(c["age"] - 65.0, 0.0)
    sepsis_signs = np.abs(c["temperature"] - 37.0) * (c["wbc"] > 12.0)
    return (
        4.0 * np.maximum(shock_index - 0.7, 0.0)
        + 1.2 * np.log(c["lactate"]) * older
        + 0.25 * np.maximum(c["resp_rate"] - 20.0, 0.0)
        + 0.35 * np.maximum(94.0 - c["spo2"], 0.0)
        + 0.8 * sepsis_signs
        + 1.0 * np.maximum(np.log(c["creatinine"]), 0.0)
        + 0.02 * np.maximum(c["age"] - 70.0, 0.0)
        + 0.5
    )


def generate_site(seed: int, site: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Measured features float32 [n, 12] (not yet standardised) and labels int64 [n] for one hospital."""
    rng = site_rng(seed, site, GENERATE_STREAM)
    # Who the hospital serves and how it measures, drawn before any patient so it does not depend on n.
    age_mean, age_sd = rng.uniform(48.0, 74.0), rng.uniform(10.0, 18.0)
    lab_scale = rng.uniform(0.8, 1.25, size=len(LABS))
    lab_shift = rng.uniform(-0.3, 0.3, size=len(LABS))
    temperature_offset = rng.uniform(-0.3, 0.3)
    spo2_offset = rng.uniform(-1.5, 1.5)
    lactate_missing = rng.uniform(0.0, 0.4)

    labels = sample_site_labels(rng, len(CLASS_NAMES), n)
    wanted = np.bincount(labels, minlength=len(CLASS_NAMES))
    # Draw patients until every disposition has enough, then keep the first of each: this imposes the site's
    # case mix while keeping the ground truth p(features | disposition) of its population.
    pools: list[np.ndarray] = []
    pool_labels: list[np.ndarray] = []
    found = np.zeros_like(wanted)
    while (found < wanted).any():
        x = _patients(rng, max(4 * n, 256), age_mean, age_sd)
        y = np.digitize(severity(x) + NOISE_SCALE * rng.logistic(size=len(x)), SEVERITY_CUTS)
        pools.append(x)
        pool_labels.append(y)
        found += np.bincount(y, minlength=len(CLASS_NAMES))
    x_all, y_all = np.concatenate(pools), np.concatenate(pool_labels)
    keep = np.concatenate([np.flatnonzero(y_all == k)[: wanted[k]] for k in range(len(wanted))])
    keep = rng.permutation(keep)
    x, y = x_all[keep].copy(), y_all[keep].astype(np.int64)

    for j, (name, typical_sd) in enumerate(LABS.items()):
        x[:, _COL[name]] = x[:, _COL[name]] * lab_scale[j] + lab_shift[j] * typical_sd
    x[:, _COL["temperature"]] += temperature_offset
    x[:, _COL["spo2"]] = np.minimum(x[:, _COL["spo2"]] + spo2_offset, 100.0)
    missing = rng.random(n) < lactate_missing
    if missing.any() and not missing.all():
        x[missing, _COL["lactate"]] = x[~missing, _COL["lactate"]].mean()
    return x.astype(np.float32), y
