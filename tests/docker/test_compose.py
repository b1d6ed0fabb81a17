"""The compose file describes a coordinator plus three sites, and every hydrafl flag it uses exists (a run's
configuration keys are flags of `admin run create` without being listed in its help)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.config_keys import key_type

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def test_compose_has_a_coordinator_and_three_sites_using_real_flags():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    sites = [name for name, service in services.items() if "hydrafl site" in " ".join(service.get("command", []))]
    assert len(sites) == 3 and "coordinator" in services
    for service in services.values():
        text = " ".join(service.get("command", []))
        for command in re.findall(r"hydrafl ((?:admin \w+ \w+)|server|site)", text):
            usage = CliRunner().invoke(app, [*command.split(), "--help"]).output
            segment = text.split(f"hydrafl {command}", 1)[1].split(";")[0]
            for flag in re.findall(r"(--[a-z-]+)", segment):
                known = flag in usage or (command == "admin run create" and key_type(flag[2:]) is not None)
                assert known, f"{flag} is not an option of `hydrafl {command}`"
    dockerfile = (DOCKER / "Dockerfile").read_text()
    for folder in ("hydrafl", "server", "client", "proto", "strategies", "benchmarks"):
        assert f"COPY {folder} {folder}" in dockerfile
