"""A site's own settings travel as Flower's flat node_config and come back typed: unknown keys, wrong types and
bad values are refused with the key or flag named, and the keys the simulation's grids set are read as well."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from hydrafl.simulation.grid import InProcessGrid
from hydrafl.site_config import SiteConfig
from hydrafl.validation import ConfigError

EVERY_FIELD = SiteConfig(
    data_path=Path("/data/visits.csv"),
    label_column="outcome",
    model_dir=Path("/models"),
    nproc=2,
    max_restarts=3,
    nnodes=2,
    rdzv="10.0.0.5:29400",
    bf16=False,
    stream_layers=True,
    window=3,
    memory_mb=512.0,
    speed=0.5,
    tier="small",
    demo_site=1,
    partition_id=4,
    num_partitions=5,
    pooled=True,
)


def test_a_round_trip_through_node_config_keeps_every_field():
    node_config = EVERY_FIELD.to_node_config()
    assert all(isinstance(value, bool | int | float | str) for value in node_config.values())
    assert node_config["data-path"] == "/data/visits.csv" and node_config["bf16"] is False
    assert SiteConfig.from_node_config(node_config) == EVERY_FIELD
    assert SiteConfig.from_node_config(SiteConfig().to_node_config()) == SiteConfig()


def test_only_the_settings_a_site_gave_are_in_its_node_config():
    assert SiteConfig(nproc=4).to_node_config() == {"nproc": 4}
    assert SiteConfig(nproc=2, max_restarts=3).to_node_config() == {"nproc": 2, "max-restarts": 3}
    assert SiteConfig(memory_mb=0.0).to_node_config() == {"memory-mb": 0.0}  # 0 declares "no limit"


@pytest.mark.parametrize(
    ("node_config", "named"),
    [
        ({"nprocs": 2}, "unknown node_config key 'nprocs'"),
        ({"nproc": "2"}, "node_config 'nproc' must be int"),
        ({"nproc": True}, "node_config 'nproc' must be int"),
        ({"data-path": 3}, "node_config 'data-path' must be str"),
        ({"pooled": 1}, "node_config 'pooled' must be bool"),
    ],
)
def test_from_node_config_refuses_unknown_keys_and_wrong_types_naming_the_key(node_config, named):
    with pytest.raises(ConfigError, match=named):
        SiteConfig.from_node_config(node_config)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tier": "huge"}, "--tier 'huge': choose one of small, medium, large"),
        ({"nproc": 0}, "--nproc must be at least 1"),
        ({"max_restarts": -1}, "--max-restarts must be at least 0"),
        ({"window": 0}, "--window must be at least 1"),
        ({"memory_mb": -1.0}, "--memory-mb must be at least 0"),
        ({"speed": 0.0}, "node_config 'speed' must be positive"),
        ({"partition_id": -1}, "node_config 'partition-id' must be at least 0"),
        ({"label_column": "outcome"}, "--label-column needs --data"),
        ({"nnodes": 2}, "--nnodes 2 needs --rdzv HOST:PORT"),
    ],
)
def test_a_bad_value_names_the_flag_that_set_it(fields, named):
    with pytest.raises(ConfigError, match=named):
        SiteConfig(**fields)
    node_config = {key.replace("_", "-"): value for key, value in fields.items()}
    with pytest.raises(ConfigError, match=named):
        SiteConfig.from_node_config(node_config)


def test_the_simulation_grids_node_configs_read_back():
    seen: dict[int, SiteConfig] = {}
    app = ClientApp()

    @app.query("site")
    def site(message: Message, context: Context) -> Message:
        seen[context.node_id] = SiteConfig.from_node_config(context.node_config)
        return Message(RecordDict(), reply_to=message)

    grid = InProcessGrid(app, 3, pooled_site=True)
    nodes = [*grid.get_node_ids(), grid.reference_node]
    probes = [Message(RecordDict(), dst_node_id=node, message_type="query.site") for node in nodes]
    replies = grid.send_and_receive(probes)
    assert not any(reply.has_error() for reply in replies)
    sites = [seen[node] for node in nodes]
    assert [site.index for site in sites] == [0, 1, 2, 3] and [site.pooled for site in sites] == [
        False
    ] * 3 + [True]
    assert not any(site.deployed for site in sites)


def test_a_site_started_by_hydrafl_site_is_deployed_and_its_index_is_its_demo_slot():
    assert SiteConfig(data_path=Path("visits.csv")).deployed
    demo = SiteConfig.from_node_config({"demo-site": 2})
    assert demo.deployed and demo.index == 2
