"""The elastic loader gives the same global batches and round hash for any world size, and across resumes."""

from __future__ import annotations

import itertools

import pytest

from hydrafl.kernels.elastic_loader import (
    ElasticLoader,
    LaneCountChangedError,
    LoaderCheckpointError,
    LoaderConfigError,
    MissingLaneError,
    WorldSizeError,
    assemble_global_batch,
    hash_global_batches,
    merge_state_dicts,
)

DATASET, BATCH, LANES, SEED, ROUND = 203, 16, 8, 7, 3  # 12 full global batches, 11 samples skipped


def ranks(world_size: int, **overrides: int) -> list[ElasticLoader]:
    """W loaders, rank 0 .. W-1, as the W processes of one site would build them."""
    settings = {
        "global_batch_size": BATCH,
        "lanes": LANES,
        "seed": SEED,
        "server_round": ROUND,
        **overrides,
    }
    return [
        ElasticLoader(DATASET, world_size=world_size, rank=rank, **settings)
        for rank in range(world_size)
    ]


def global_batches(loaders: list[ElasticLoader], steps: int | None = None) -> list[list[int]]:
    """Step the ranks together and assemble each step's global batch from the rank batches."""
    batches = []
    for rank_batches in itertools.islice(zip(*loaders, strict=True), steps):
        assert {len(batch) for batch in rank_batches} == {BATCH // len(loaders)}
        batches.append(assemble_global_batch(rank_batches, LANES))
    return batches


def test_global_batches_and_round_hash_are_the_same_for_world_1_2_4_8() -> None:
    results = {}
    for world in (1, 2, 4, 8):
        loaders = ranks(world)
        batches = global_batches(loaders)
        hashes = {loader.round_hash() for loader in loaders}
        assert hashes == {hash_global_batches(batches)}
        results[world] = (batches, hashes.pop())
    reference_batches, reference_hash = results[1]
    assert len(reference_batches) == DATASET // BATCH
    samples = list(itertools.chain.from_iterable(reference_batches))
    assert (
        len(set(samples)) == len(samples) == (DATASET // BATCH) * BATCH
    )  # no sample twice in a round
    for batches, digest in results.values():
        assert batches == reference_batches
        assert digest == reference_hash


def test_order_is_a_pure_function_of_seed_and_round() -> None:
    first = global_batches(ranks(2))
    assert global_batches(ranks(4)) == first
    assert global_batches(ranks(2, server_round=ROUND + 1)) != first
    assert global_batches(ranks(2, seed=SEED + 1)) != first
    loader = ranks(1)[0]
    list(loader)
    loader.start_round(ROUND)
    assert loader.step == 0
    assert global_batches([loader]) == first


def test_round_hash_covers_the_batches_handed_out() -> None:
    loader = ranks(1)[0]
    empty = loader.round_hash()
    handed_out = list(itertools.islice(loader, 3))
    assert loader.step == 3
    assert loader.round_hash() == hash_global_batches(handed_out) != empty


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 8), (8, 1), (1, 4)])
def test_resume_on_a_different_world_size_continues_the_same_stream(
    before: int, after: int
) -> None:
    uninterrupted = ranks(1)
    expected = global_batches(uninterrupted)
    loaders = ranks(before)
    seen = global_batches(loaders, steps=5)
    checkpoint = merge_state_dicts(loader.state_dict() for loader in loaders)
    resumed = ranks(after, server_round=0)  # the checkpoint carries the round
    for loader in resumed:
        loader.load_state_dict(checkpoint)
    assert {loader.step for loader in resumed} == {5}
    seen += global_batches(resumed)
    assert seen == expected
    assert {loader.round_hash() for loader in resumed} == {uninterrupted[0].round_hash()}


def test_state_survives_json_style_string_lane_keys() -> None:
    loaders = ranks(2)
    global_batches(loaders, steps=2)
    checkpoint = merge_state_dicts(loader.state_dict() for loader in loaders)
    checkpoint["lane_positions"] = {
        str(lane): pos for lane, pos in checkpoint["lane_positions"].items()
    }
    resumed = ranks(1)[0]
    resumed.load_state_dict(checkpoint)
    assert resumed.step == 2


def test_configuration_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(
        WorldSizeError, match="world size 16 must be between 1 and the number of lanes 8"
    ):
        ranks(16)
    with pytest.raises(
        WorldSizeError, match="8 lanes do not divide evenly over world size 3.*1, 2, 4, 8"
    ):
        ranks(3)
    with pytest.raises(WorldSizeError, match="rank 2 is outside"):
        ElasticLoader(DATASET, global_batch_size=BATCH, lanes=LANES, world_size=2, rank=2)
    with pytest.raises(
        LoaderConfigError, match="global batch size 12 must be a positive multiple of the 8 lanes"
    ):
        ranks(1, global_batch_size=12)
    with pytest.raises(LoaderConfigError, match="holds no full global batch"):
        ElasticLoader(10, global_batch_size=BATCH, lanes=LANES)
    with pytest.raises(LoaderConfigError, match="lanes=0"):
        ElasticLoader(DATASET, global_batch_size=BATCH, lanes=0)


def test_resuming_with_a_different_lane_count_is_refused() -> None:
    checkpoint = merge_state_dicts(loader.state_dict() for loader in ranks(2))
    with pytest.raises(LaneCountChangedError, match="the checkpoint has 8 lanes, this loader 16"):
        ElasticLoader(DATASET, global_batch_size=BATCH, lanes=16).load_state_dict(checkpoint)
    with pytest.raises(LaneCountChangedError, match="ranks disagree on lanes"):
        merge_state_dicts([ranks(2)[0].state_dict(), ranks(1, lanes=16)[0].state_dict()])


def test_a_checkpoint_missing_a_lane_is_refused() -> None:
    first_rank_only = ranks(2)[0].state_dict()
    with pytest.raises(MissingLaneError, match="lacks lanes \\[4, 5, 6, 7\\] of 8"):
        ranks(1)[0].load_state_dict(first_rank_only)


def test_inconsistent_checkpoints_are_refused() -> None:
    loaders = ranks(2)
    next(iter(loaders[0]))  # rank 0 one step ahead of rank 1
    with pytest.raises(LoaderCheckpointError, match="lane positions differ"):
        ranks(1)[0].load_state_dict(merge_state_dicts(loader.state_dict() for loader in loaders))
    with pytest.raises(LoaderCheckpointError, match="the checkpoint's seed is 8"):
        ranks(1)[0].load_state_dict(
            merge_state_dicts(loader.state_dict() for loader in ranks(2, seed=SEED + 1))
        )
    with pytest.raises(LoaderCheckpointError, match="ranks disagree on server_round"):
        merge_state_dicts([ranks(2)[0].state_dict(), ranks(2, server_round=0)[1].state_dict()])
    with pytest.raises(LoaderCheckpointError, match="no states to merge"):
        merge_state_dicts([])


def test_further_passes_are_fresh_permutations_and_resume_in_their_pass() -> None:
    first = ElasticLoader(40, global_batch_size=8, lanes=4, seed=2, server_round=3, epoch=1)
    assert sorted(
        first.global_batch(0)
        + first.global_batch(1)
        + first.global_batch(2)
        + first.global_batch(3)
        + first.global_batch(4)
    ) == list(range(40))
    assert (
        first._order.tolist()
        != ElasticLoader(40, global_batch_size=8, lanes=4, seed=2, server_round=3)._order.tolist()
    )
    next(iter(first))
    resumed = ElasticLoader(
        40, global_batch_size=8, lanes=4, world_size=2, rank=1, seed=2, server_round=0
    )
    resumed.load_state_dict(first.state_dict())
    assert (resumed.epoch, resumed.step) == (1, 1)
    assert resumed.global_batch(1) == first.global_batch(1)
