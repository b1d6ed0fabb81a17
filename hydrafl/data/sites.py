"""Per-site randomness and label prevalence shared by the synthetic generators.

Every random draw comes from a generator seeded by (seed, site, stream), never the global RNG, so a cohort
is bit-identical for the same arguments and a site's raw rows do not depend on how many sites there are.
"""

from __future__ import annotations

import numpy as np

GENERATE_STREAM = 0
SPLIT_STREAM = 1
POOL_STREAM = 2
DUPLICATE_STREAM = 3


def site_rng(seed: int, site: int, stream: int) -> np.random.Generator:
    """An independent generator for one purpose (`stream`) at one site."""
    return np.random.default_rng([seed, site, stream])


def sample_site_labels(
    rng: np.random.Generator,
    num_classes: int,
    n: int,
    *,
    alpha: float = 1.0,
    uniform_mix: float = 0.25,
) -> np.ndarray:
    """Labels int64 [n] with a site-specific prevalence: Dirichlet(alpha) mixed with some uniform mass.

    Each hospital sees its own case mix; the uniform share and a floor of a few rows per class keep every
    class present at every site (when n allows), as in a real consortium where no ward is empty.
    """
    prevalence = (1.0 - uniform_mix) * rng.dirichlet(
        np.full(num_classes, alpha)
    ) + uniform_mix / num_classes
    floor = min(3, n // num_classes)
    guaranteed = np.repeat(np.arange(num_classes), floor)
    drawn = rng.choice(num_classes, size=n - guaranteed.size, p=prevalence)
    return rng.permutation(np.concatenate([guaranteed, drawn])).astype(np.int64)
