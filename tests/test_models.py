"""Task models: a site's classifier built from a local checkpoint directory, offline."""

from __future__ import annotations

import pytest
import torch

from hydrafl.data import load_cohort
from hydrafl.models import build_model


@pytest.mark.parametrize("task_name", ["clinical-text", "chest-xray"])
def test_a_site_builds_its_classifier_from_a_local_checkpoint_directory(tmp_path, task_name):
    """`--model DIR` for the text (BERT) and image (ViT) tasks: the saved weights come back, offline."""
    cohort = load_cohort(task_name, num_sites=1, samples_per_site=8)
    saved = build_model(cohort.task, seed=3)
    saved.net.save_pretrained(tmp_path / "checkpoint")
    loaded = build_model(cohort.task, model=str(tmp_path / "checkpoint"), seed=0)
    assert type(loaded.net) is type(saved.net)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    x = cohort.sites[0].train_x[:4]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), saved.eval()(x))
    with pytest.raises(ValueError, match="neither 'tiny' nor a local checkpoint directory"):
        build_model(cohort.task, model=str(tmp_path / "missing"))
