"""The compose file describes a coordinator plus three sites, and every hydrafl flag it uses exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from hydrafl.cli import app

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
                assert flag in usage, f"{flag} is not an option of `hydrafl {command}`"
    dockerfile = (DOCKER / "Dockerfile").read_text()
    for folder in ("hydrafl", "server", "client", "proto", "strategies", "benchmarks"):
        assert f"COPY {folder} {folder}" in dockerfile
