"""The image-model benchmark's quick mode end to end: real digits as an image folder, the CNN against the ViT."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_image_models_quick(tmp_path):
    result = run_quick("image_models", tmp_path, timeout_s=300)
    assert result["quick"] is True and result["images"] == 300
    assert set(result["models"]) == {"cnn", "vit"}
    for entry in result["models"].values():
        assert len(entry["mean_accuracy"]) == result["config"]["rounds"] + 1 and entry["params"] > 0
    assert result["winner"] == result["default"] == "cnn"
