"""Synthetic "chest-xray": 1x32x32 frontal chest radiograph-like images rendered analytically in numpy.

Anatomy (thorax, dark lung fields, ribs, spine, heart) varies per patient; findings are drawn with
overlapping severities (a large normal heart vs a mild cardiomegaly, a faint patch of pneumonia) so the task
is not trivially separable. Each hospital's scanner adds its own gamma, contrast, offset, noise, blur and
patient positioning, the feature shift a model trained at one site has never seen.
"""

from __future__ import annotations

import numpy as np

from hydrafl.data.schema import TaskSpec
from hydrafl.data.sites import GENERATE_STREAM, sample_site_labels, site_rng

IMAGE_SIZE = 32
CLASS_NAMES = ("normal", "pneumonia", "cardiomegaly", "effusion")
NORMAL, PNEUMONIA, CARDIOMEGALY, EFFUSION = range(len(CLASS_NAMES))


def task_spec() -> TaskSpec:
    return TaskSpec(
        name="chest-xray",
        modality="image",
        num_classes=len(CLASS_NAMES),
        class_names=CLASS_NAMES,
        image_size=IMAGE_SIZE,
        channels=1,
    )


def _ellipse(
    x: np.ndarray, y: np.ndarray, cx: np.ndarray, cy: np.ndarray, rx: np.ndarray, ry: np.ndarray
) -> np.ndarray:
    """Soft-edged ellipse masks in [0, 1]; per-image parameters broadcast over the pixel grid."""
    r = np.sqrt(
        ((x - cx[:, None, None]) / rx[:, None, None]) ** 2
        + ((y - cy[:, None, None]) / ry[:, None, None]) ** 2
    )
    return np.clip((1.0 - r) * 8.0, 0.0, 1.0)


def _blur(images: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur (radius 2, edge-padded): the scanner's point-spread function."""
    taps = np.exp(-0.5 * (np.arange(-2, 3) / max(sigma, 1e-3)) ** 2)
    taps /= taps.sum()
    for axis in (1, 2):
        width = [(0, 0)] * 3
        width[axis] = (2, 2)
        padded = np.pad(images, width, mode="edge")
        images = sum(
            w * np.take(padded, np.arange(k, k + IMAGE_SIZE), axis=axis) for k, w in enumerate(taps)
        )
    return images


def generate_site(seed: int, site: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw images float32 [n, 1, 32, 32] (not yet standardised) and labels int64 [n] for one hospital."""
    rng = site_rng(seed, site, GENERATE_STREAM)
    # The hospital's scanner and positioning protocol, drawn before any image so it does not depend on n.
    gamma = rng.uniform(0.9, 1.12)
    contrast = rng.uniform(0.93, 1.07)
    offset = rng.uniform(-0.025, 0.025)
    noise = rng.uniform(0.04, 0.12)
    blur = rng.uniform(0.3, 1.1)
    tilt = rng.uniform(-0.09, 0.09)  # radians, ~5 degrees
    shift = rng.uniform(-0.06, 0.06, size=2)  # ~1 px

    labels = sample_site_labels(rng, len(CLASS_NAMES), n)

    def u(low: float, high: float) -> np.ndarray:
        """One uniform draw per image."""
        return rng.uniform(low, high, size=n)

    angle = tilt + rng.normal(0.0, 0.04, size=n)
    grid = np.linspace(-1.0, 1.0, IMAGE_SIZE)
    gy, gx = np.meshgrid(grid, grid, indexing="ij")
    dx = gx[None] - shift[0] - rng.normal(0.0, 0.03, size=(n, 1, 1))
    dy = gy[None] - shift[1] - rng.normal(0.0, 0.03, size=(n, 1, 1))
    cos, sin = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
    x, y = cos * dx + sin * dy, -sin * dx + cos * dy

    zeros = np.zeros(n)
    body = _ellipse(x, y, zeros, u(0.0, 0.1), u(0.85, 0.98), u(0.95, 1.1))
    lung_rx, lung_ry, lung_y = u(0.28, 0.34), u(0.58, 0.68), u(-0.1, 0.0)
    right_lung = _ellipse(x, y, -u(0.38, 0.44), lung_y, lung_rx, lung_ry)
    left_lung = _ellipse(x, y, u(0.38, 0.44), lung_y, lung_rx, lung_ry)
    lungs = np.maximum(right_lung, left_lung)
    ribs = 0.5 + 0.5 * np.sin(
        y * u(16.0, 20.0)[:, None, None] + 4.0 * x**2 + u(0.0, 2 * np.pi)[:, None, None]
    )
    spine = np.exp(-((x / 0.07) ** 2)) * body

    # Heart: normal hearts vary in size, cardiomegaly overlaps their upper range.
    heart_scale = np.where(labels == CARDIOMEGALY, u(1.15, 1.5), u(0.85, 1.2))
    heart = _ellipse(x, y, u(0.1, 0.18), u(0.3, 0.38), 0.28 * heart_scale, 0.2 * heart_scale)

    # Pneumonia: a textured patch in a random lung, of varying size and density.
    side = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    patch = np.exp(
        -((x - (side * u(0.3, 0.45))[:, None, None]) ** 2 + (y - u(-0.35, 0.2)[:, None, None]) ** 2)
        / (2 * u(0.1, 0.18)[:, None, None] ** 2)
    )
    texture = 0.6 + 0.4 * rng.random((n, IMAGE_SIZE, IMAGE_SIZE))
    pneumonia = (
        (labels == PNEUMONIA)[:, None, None] * u(0.25, 0.6)[:, None, None] * patch * texture * lungs
    )

    # Effusion: fluid filling the lung base, its surface curving up laterally (the meniscus sign).
    lateral = np.abs(x - (side * 0.41)[:, None, None])
    level = (u(0.15, 0.35)[:, None, None]) - 1.5 * lateral**2
    base_lung = np.where(side[:, None, None] < 0, right_lung, left_lung)
    fluid = np.clip((y - level) * 12.0, 0.0, 1.0) * base_lung
    effusion = (labels == EFFUSION)[:, None, None] * u(0.3, 0.6)[:, None, None] * fluid

    density = (
        0.55 * body
        - 0.38 * lungs
        + 0.12 * ribs * lungs
        + 0.25 * spine
        + 0.3 * heart
        + pneumonia
        + effusion
    )
    image = np.clip(density, 0.0, 1.0) ** gamma
    image = contrast * _blur(image, blur) + offset
    image = image + rng.normal(0.0, noise, size=image.shape)
    return image[:, None].astype(np.float32), labels
