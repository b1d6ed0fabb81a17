"""Task models: a site's classifier built from a local checkpoint directory, offline; the small CNN a user's image
folder gets by default, which learns real digits where the tiny ViT barely does."""

from __future__ import annotations

import pytest
import torch
from transformers import ViTForImageClassification

from hydrafl.benchmarks.image_models import write_folder
from hydrafl.catalog import IMAGE_FOLDER_MODEL
from hydrafl.config import RunConfig
from hydrafl.data import load_cohort
from hydrafl.models import SmallCNN, build_model
from hydrafl.simulation.compare import run_strategy


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


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A user's image folder of real scanned digits: 30 PNGs per class, 10 classes."""
    return write_folder("digits", tmp_path_factory.mktemp("images"), per_class=30)


@pytest.mark.parametrize(("width", "blocks", "side"), [(8, 5, 32), (4, 2, 16), (8, 3, 20)])
def test_the_small_cnn_maps_a_batch_of_images_to_one_logit_per_class(width, blocks, side):
    net = SmallCNN(1, 7, width=width, blocks=blocks)
    assert net(torch.randn(5, 1, side, side)).shape == (5, 7)
    assert net.head.in_features == width * 2 ** (blocks - 1)
    assert not list(
        net.buffers()
    )  # GroupNorm: every coordinate is a parameter that federated averaging shares


def test_the_small_cnns_norm_groups_never_exceed_a_blocks_channels():
    net = SmallCNN(1, 3, width=2, blocks=3, norm_groups=4)
    norms = [layer for layer in net.features if isinstance(layer, torch.nn.GroupNorm)]
    assert [(n.num_groups, n.num_channels) for n in norms] == [(2, 2), (4, 4), (4, 8)]
    assert (net.width, net.blocks, net.norm_groups) == (2, 3, 4)


def test_an_image_folder_gets_the_cnn_and_the_synthetic_xrays_keep_the_vit(digits):
    folder = load_cohort(data_path=digits, num_sites=1).task
    model = build_model(folder)
    assert IMAGE_FOLDER_MODEL == "cnn" and isinstance(model.net, SmallCNN)
    assert isinstance(build_model(folder, model="vit").net, ViTForImageClassification)
    xrays = load_cohort("chest-xray", num_sites=1, samples_per_site=8).task
    assert isinstance(build_model(xrays).net, ViTForImageClassification)
    with pytest.raises(ValueError, match="'cnn' is an image model"):
        build_model(load_cohort("tabular", num_sites=1, samples_per_site=8).task, model="cnn")


def test_the_default_model_learns_real_digits_where_the_tiny_vit_barely_does(digits):
    """The measured choice (`benchmarks/image_models.py`) holds on a small subset: fedavg, 3 sites, 3 rounds."""
    run = RunConfig(data=str(digits), sites=3, rounds=3, seed=0)
    default = run_strategy(run, "inprocess")[-1]["accuracy"]
    vit = run_strategy(run.replace(model="vit"), "inprocess")[-1]["accuracy"]
    assert default >= 0.6 > vit, (default, vit)
