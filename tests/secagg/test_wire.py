"""The protocol's messages survive their flat form, and a malformed one is a SecAggError naming the field."""

from __future__ import annotations

import pytest

from hydrafl.secagg import SecAggError, SecAggParams, wire
from hydrafl.secagg.site import SignedKeys


def test_a_setup_request_round_trips_with_its_layout():
    layout = wire.Layout(
        "num-examples",
        ["a", "b"],
        per_coordinate=True,
        count_once=True,
        shapes=[(2, 3), (4,)],
        metrics=[("train_loss", 64.0)],
    )
    params = SecAggParams(num_shares=3, site_clip=2.5, purpose="evaluate")
    record = wire.keys_request(7, [3, 1, 2], params, layout)
    assert wire.parse_keys_request(record) == (7, [3, 1, 2], params, layout)
    with pytest.raises(SecAggError, match="metric ranges must be finite and > 0"):
        wire.parse_keys_request({**record, "metric-ranges": [0.0]})
    with pytest.raises(SecAggError, match="purpose must be one of"):
        wire.parse_keys_request({**record, "param.purpose": "plan"})
    assert (
        layout.scaled(SecAggParams()).max_weight == 1
    )  # every site weighs 1: nothing scales the update down


def test_the_signed_keys_and_the_survivor_signatures_round_trip():
    keys = {
        2: SignedKeys(*(bytes([i]) * n for i, n in enumerate(SignedKeys.SIZES))),
        1: SignedKeys(*[b"k"] * 6),
    }
    assert wire.parse_keys_reply(wire.keys_reply(keys[2])) == keys[2]
    assert wire.parse_shares_request(wire.shares_request(1, keys)) == (1, keys)
    assert wire.parse_check_request(wire.check_request([1, 2])) == [1, 2]
    assert wire.parse_check_reply(wire.check_reply(b"s")) == b"s"
    assert wire.parse_unmask_request(wire.unmask_request([1, 2], {2: b"b", 1: b"a"})) == (
        [1, 2],
        {1: b"a", 2: b"b"},
    )
    with pytest.raises(SecAggError, match="'signature' must be bytes"):
        wire.parse_keys_reply({**wire.keys_reply(keys[2]), "signature": "text"})


def test_slices_round_trip():
    slices = {"w": (0, (1, 3)), "b": (None, ())}
    assert wire.parse_slices(wire.slices_record(slices)) == slices


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"nodes": [1, 2], "sealed": [b"x"]}, "differing lengths"),
        ({"nodes": [1, 1], "sealed": [b"x", b"y"]}, "repeats a node"),
        ({"nodes": [1], "sealed": ["text"]}, "list of bytes"),
        ({"nodes": "1", "sealed": [b"x"]}, "must be list"),
    ],
)
def test_malformed_shares_are_refused(record, message):
    with pytest.raises(SecAggError, match=message):
        wire.parse_sealed(record)


def test_a_setup_request_with_bad_parameters_or_shapes_is_refused():
    record = wire.keys_request(
        1, [1, 2], SecAggParams(), wire.Layout("w", ["a"], True, False, [(2,)])
    )
    with pytest.raises(SecAggError, match="bad secure-aggregation parameters"):
        wire.parse_keys_request({**record, "param.clipping_range": -1.0})
    with pytest.raises(SecAggError, match="shapes do not match"):
        wire.parse_keys_request({**record, "ranks": [2]})
