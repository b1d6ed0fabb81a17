"""Without Docker: the compose file describes PostgreSQL, a coordinator and three sites, every hydrafl flag it uses
exists (a run's configuration keys are flags of `admin run create` without being listed in its help), each site
sees only its own token and data, and the images run as a non-root user with no secrets or wheels copied in.
test_compose_deployment.py builds and runs all of it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.config_keys import key_type

DOCKER = Path(__file__).resolve().parents[2] / "docker"
IMAGE_TARGETS = {"hydrafl-coordinator:latest": "coordinator", "hydrafl-site:latest": "site"}


def stages(dockerfile: str) -> dict[str, str]:
    """Each `FROM ... AS name` stage's text, by name."""
    parts = re.split(r"^FROM .* AS (\w[\w-]*)\s*$", dockerfile, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def entrypoint(stage: str) -> list[str]:
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", stage, flags=re.MULTILINE).group(1))


def hydrafl_calls(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(subcommand, its arguments) for each `hydrafl ...` in argv, looking inside `sh -c` scripts."""
    if argv[:1] == ["sh"]:
        script = argv[-1].replace("$$", "$")
        pieces = re.split(r";|\|\||&&|\|(?!\|)|\bthen\b|\bdo\b", script)
        return [call for piece in pieces for call in hydrafl_calls(shlex.split(piece.strip()))]
    if argv[:1] != ["hydrafl"]:
        return []
    words = argv[1:]
    depth = 3 if words[:1] == ["admin"] else 1
    return [(" ".join(words[:depth]), words[depth:])]


def test_compose_runs_postgres_a_coordinator_and_three_sites_with_real_flags():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    targets = stages((DOCKER / "Dockerfile").read_text())
    sites = [
        name for name, service in services.items() if service.get("image") == "hydrafl-site:latest"
    ]
    assert len(sites) == 3 and {"coordinator", "postgres", "enrol"} <= set(services)
    for name, service in services.items():
        image = service.get("image", "")
        if image not in IMAGE_TARGETS:
            continue
        argv = service.get("entrypoint") or entrypoint(targets[IMAGE_TARGETS[image]])
        for command, args in hydrafl_calls([*argv, *service.get("command", [])]):
            usage = CliRunner().invoke(app, [*command.split(), "--help"]).output
            for flag in (word for word in args if word.startswith("--")):
                known = flag in usage or (
                    command == "admin run create" and key_type(flag[2:]) is not None
                )
                assert known, f"{name}: {flag} is not an option of `hydrafl {command}`"


def test_each_site_mounts_only_its_own_token_and_data_and_never_reaches_the_database():
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    sites = {
        name: service
        for name, service in services.items()
        if service.get("image") == "hydrafl-site:latest"
    }
    volumes = {
        name: [mount.split(":")[0] for mount in service["volumes"]]
        for name, service in sites.items()
    }
    for name, mounts in volumes.items():
        assert sorted(mounts) == sorted([f"{name}-token", f"{name}-data"])
        assert f"{name}-token:/run/secrets:ro" in sites[name]["volumes"]
        assert not set(services["postgres"]["networks"]) & set(sites[name]["networks"])
    assert "site-token" in " ".join(entrypoint(stages((DOCKER / "Dockerfile").read_text())["site"]))


def test_images_run_unprivileged_with_a_healthcheck_and_nothing_secret_inside():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    targets = stages(dockerfile)
    assert re.search(r"^USER hydrafl$", targets["hydrafl"], flags=re.MULTILINE)
    for name in ("coordinator", "site"):
        assert re.search(rf"^FROM hydrafl AS {name}$", dockerfile, flags=re.MULTILINE)
        assert "USER" not in targets[name], f"{name} changes user"
    assert (
        "HEALTHCHECK" in targets["coordinator"] and "hydrafl-healthcheck" in targets["coordinator"]
    )
    assert "HEALTHCHECK" in (DOCKER / "postgres.Dockerfile").read_text()
    assert re.search(
        r"^USER postgres$", (DOCKER / "postgres.Dockerfile").read_text(), flags=re.MULTILINE
    )
    # Wheels and the proxy CA come in through RUN mounts only; nothing secret is COPY'd or ARG'd.
    assert not re.search(
        r"^(COPY|ADD) .*(wheelhouse|dist|\.pem|token)",
        dockerfile,
        flags=re.MULTILINE | re.IGNORECASE,
    )
    assert (
        "--mount=type=secret,id=ca," in dockerfile
        and "--mount=type=bind,source=wheelhouse" in dockerfile
    )
    assert not re.search(r"^ARG .*(TOKEN|PASSWORD|KEY|CERT)", dockerfile, flags=re.MULTILINE)
    ignored = (DOCKER / ".dockerignore").read_text().splitlines()
    assert ignored[1] == "*" and all(line.startswith("!") for line in ignored[2:])
