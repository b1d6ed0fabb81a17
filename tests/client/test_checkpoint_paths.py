"""A deployed site loads a checkpoint the run names only from inside its operator's --model-dir."""

from __future__ import annotations

import pytest

from hydrafl.client.site_app import check_checkpoint_paths
from hydrafl.config import RunConfig
from hydrafl.site_config import SiteConfig


def test_a_run_cannot_make_a_deployed_site_read_a_directory_of_its_choosing(tmp_path):
    allowed, elsewhere = tmp_path / "models", tmp_path / "private"
    (allowed / "bert").mkdir(parents=True)
    elsewhere.mkdir()
    for node in ({"demo-site": 0}, {"data-path": "visits.csv"}):
        site, with_dir = (
            SiteConfig.from_node_config(node),
            SiteConfig.from_node_config({**node, "model-dir": str(allowed)}),
        )
        check_checkpoint_paths(
            RunConfig(task="clinical-notes-lm", distill_teacher="init"), site
        )  # built-ins: nothing needed
        with pytest.raises(PermissionError, match="outside this site's --model-dir"):
            check_checkpoint_paths(RunConfig(model=str(allowed / "bert")), site)
        check_checkpoint_paths(RunConfig(model=str(allowed / "bert")), with_dir)
        for escape in (str(elsewhere), str(allowed / ".." / "private")):
            with pytest.raises(PermissionError):
                check_checkpoint_paths(RunConfig(model=escape), with_dir)
        with pytest.raises(PermissionError, match="distill-teacher"):
            check_checkpoint_paths(
                RunConfig(task="clinical-notes-lm", distill_teacher=str(elsewhere)), site
            )
    simulated = SiteConfig.from_node_config({"partition-id": 0})
    check_checkpoint_paths(
        RunConfig(model=str(elsewhere)), simulated
    )  # simulation: the researcher's own
