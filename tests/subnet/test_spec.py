"""SubnetSpec: canonical form, validation messages, and the flat ConfigRecord round trip."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord

from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.spec import SpecError, SubnetSpec


def test_spec_is_canonical_sorted_and_aligned():
    spec = SubnetSpec(layers=[2, 0], heads=[[1, 0], [3]])
    assert spec.layers == (0, 2)
    assert spec.heads == ((3,), (0, 1))  # heads follow their layer through the sort
    assert spec.heads_for(2) == (0, 1)
    assert spec.heads_for(0) == (3,)
    assert SubnetSpec(layers=(1,)).heads_for(1) is None
    with pytest.raises(KeyError, match="layer 1 is not selected"):
        spec.heads_for(1)
    assert SubnetSpec.full(3) == SubnetSpec(layers=(0, 1, 2))


def test_config_round_trip_through_a_flower_config_record():
    spec = SubnetSpec(
        layers=(0, 2, 5),
        heads=((1,), (0, 2, 3), (2,)),
        bypass=True,
        train_outside=False,
        freeze_heads=True,
    )
    config = spec.to_config()
    assert config == {
        "hydra.layers": [0, 2, 5],
        "hydra.all-heads": False,
        "hydra.width-ratio": 1.0,
        "hydra.bypass": True,
        "hydra.train-outside": False,
        "hydra.freeze-heads": True,
        "hydra.head-counts": [1, 3, 1],
        "hydra.heads": [1, 0, 2, 3, 2],
    }
    record = ConfigRecord(config)  # flat scalars and scalar lists only: Flower accepts it
    assert SubnetSpec.from_config(dict(record)) == spec

    all_heads = SubnetSpec(layers=(3,), width_ratio=0.5)
    record = ConfigRecord(all_heads.to_config(prefix="site-4."))
    assert sorted(record) == [
        "site-4.all-heads",
        "site-4.bypass",
        "site-4.freeze-heads",
        "site-4.layers",
        "site-4.train-outside",
        "site-4.width-ratio",
    ]
    back = SubnetSpec.from_config(dict(record), prefix="site-4.")
    assert back == all_heads and back.heads is None and back.width_ratio == 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": ()}, "empty selection: a SubnetSpec needs at least one layer"),
        ({"layers": (0, 1), "heads": ((0,), ())}, "empty selection: layer 1 keeps no heads"),
        ({"layers": (0, 0)}, "layer indices contain duplicates"),
        ({"layers": (-1,)}, "layer indices must be >= 0"),
        ({"layers": (1.0,)}, "layer indices must be integers"),
        (
            {"layers": (0, 1), "heads": ((0,),)},
            "one tuple per selected layer: 2 layers, 1 head tuples",
        ),
        ({"layers": (0,), "heads": ((1, 1),)}, "head indices of layer 0 contain duplicates"),
        ({"layers": (0,), "width_ratio": 0.0}, r"width_ratio must be a number in \(0, 1\]"),
        ({"layers": (0,), "width_ratio": 1.5}, r"width_ratio must be a number in \(0, 1\]"),
    ],
)
def test_malformed_specs_are_rejected_with_clear_errors(kwargs, message):
    with pytest.raises(SpecError, match=message):
        SubnetSpec(**kwargs)


def test_spec_checked_against_the_model(llama, bert):
    arch = find_architecture(llama)  # 3 layers, 2 KV groups (4 query heads)
    SubnetSpec(layers=(2,), heads=((1,),)).check(arch)
    with pytest.raises(SpecError, match=r"layer 3 out of range: the model has 3 layers \(0..2\)"):
        SubnetSpec(layers=(0, 3)).check(arch)
    with pytest.raises(
        SpecError,
        match=r"KV group 2 of layer 1 out of range: the model has 2 KV groups per layer \(0..1\)",
    ):
        SubnetSpec(layers=(1,), heads=((2,),)).check(arch)
    with pytest.raises(
        SpecError, match=r"head 4 of layer 0 out of range: the model has 4 heads per layer \(0..3\)"
    ):
        SubnetSpec(layers=(0,), heads=((4,),)).check(find_architecture(bert))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hydra.all-heads": True}, "config has no 'hydra.layers'"),
        ({"hydra.layers": 3, "hydra.all-heads": True}, "'hydra.layers' must be a list of integers"),
        (
            {
                "hydra.layers": [0, 1],
                "hydra.all-heads": False,
                "hydra.head-counts": [1, 2],
                "hydra.heads": [0, 1],
            },
            r"hydra.head-counts \[1, 2\] does not split hydra.heads \(length 2\) over 2 layers",
        ),
        (
            {
                "hydra.layers": [0],
                "hydra.all-heads": True,
                "hydra.width-ratio": True,
                "hydra.bypass": False,
                "hydra.train-outside": True,
            },
            "'hydra.width-ratio' must be int/float",
        ),
    ],
)
def test_malformed_configs_are_rejected(config, message):
    with pytest.raises(SpecError, match=message):
        SubnetSpec.from_config(config)
