"""End to end in real containers: build the images from a local wheelhouse (the air-gapped path, with a proxy CA
passed as a BuildKit secret), bring up docker/compose.yaml (PostgreSQL, a coordinator, three sites, the one-shot
enrolment) and follow its run to the end; then check health, users, each site's token and what the images hold.

Needs Debian's docker.io, docker-compose and debootstrap (.ci/run installs them). It uses a running daemon
($DOCKER_HOST, or the socket below) or starts dockerd itself as root, and stops it again; skipped when no daemon
can start. The base image, build cache and wheelhouse persist in /tmp between runs: measured here (2 shared
cores) ~6.5 min cold (base image 1 min, wheelhouse 0.5 min, images 3 min, run and checks 2 min), ~3.5 min warm.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "docker"
SOCKET = "/tmp/hydrafl-docker.sock"
DATA_ROOT = "/tmp/hydrafl-docker-root"  # kept between runs: the base image and the build cache
EXEC_ROOT = "/tmp/hydrafl-docker-exec"
PIDFILE = "/tmp/hydrafl-dockerd.pid"
WHEEL_CACHE = Path(os.environ.get("HYDRAFL_WHEELHOUSE", "/tmp/hydrafl-wheelhouse"))
DB_URL = "postgresql+psycopg://hydrafl@postgres:5432/hydrafl"
SITES = ("st-marys", "royal-infirmary", "city-general")
IMAGES = ("hydrafl-coordinator:latest", "hydrafl-site:latest", "hydrafl-postgres:latest")
ROUNDS = 3
RUN_DEADLINE_S = 600


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args: list[str], env: dict[str, str], timeout: float = 1200, check: bool = True, **kwargs):
    result = subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, **kwargs
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def buildkit_client() -> str | None:
    """A docker client that can build with BuildKit: one with the buildx plugin, or a 20.x/22.x client (Debian's
    docker.io) whose built-in builder does it; a newer client without buildx refuses DOCKER_BUILDKIT=1."""
    candidates = []
    for folder in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin"]:
        path = Path(folder) / "docker"
        if path.is_file() and os.access(path, os.X_OK) and str(path) not in candidates:
            candidates.append(str(path))
    for client in candidates:
        if subprocess.run([client, "buildx", "version"], capture_output=True).returncode == 0:
            return client
        version = subprocess.run([client, "--version"], capture_output=True, text=True).stdout
        major = version.split("version ", 1)[-1].split(".", 1)[0]
        if major.isdigit() and int(major) < 23:
            return client
    return None


def daemon_answers(client: str, env: dict[str, str]) -> bool:
    try:
        return run([client, "info"], env, timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def docker_env():
    """(docker client, environment with DOCKER_HOST): a daemon that answers, started here if need be."""
    client = buildkit_client()
    if client is None:
        pytest.skip(
            "no docker client that builds with BuildKit: install Debian's docker.io (or docker buildx)"
        )
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    if os.environ.get("DOCKER_HOST") and daemon_answers(client, env):
        yield client, env
        return
    env["DOCKER_HOST"] = f"unix://{SOCKET}"
    if daemon_answers(client, env):
        yield client, env
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip(
            "no Docker daemon: dockerd is not installed (apt-get install docker.io docker-compose debootstrap)"
        )
    if os.geteuid() != 0:
        pytest.skip("no Docker daemon answers and starting dockerd needs root")
    if Path(PIDFILE).exists():  # left by a dockerd that died: refuse to start otherwise
        try:
            os.kill(int(Path(PIDFILE).read_text().strip()), 0)
        except (ValueError, ProcessLookupError):
            Path(PIDFILE).unlink()
    daemon_log = Path("/tmp/hydrafl-dockerd.log")
    with daemon_log.open("w") as out:
        daemon = subprocess.Popen(
            [
                dockerd,
                "--host",
                f"unix://{SOCKET}",
                "--data-root",
                DATA_ROOT,
                "--exec-root",
                EXEC_ROOT,
                "--pidfile",
                PIDFILE,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while not daemon_answers(client, env):
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            daemon.wait()
            tail = daemon_log.read_text()[-1500:]
            pytest.skip(f"dockerd did not start (exit {daemon.returncode}); its log ends:\n{tail}")
        time.sleep(1)
    log(f"started dockerd (pid {daemon.pid}) on {SOCKET}")
    try:
        yield client, env
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def wheelhouse(env: dict[str, str]) -> tuple[Path, Path]:
    """(dependencies, hydrafl's wheel): hydrafl's wheel is rebuilt every time; the dependencies are fetched by
    docker/wheelhouse.sh (the connected half of an air-gapped build) only when the cache lacks one."""
    deps, dist = WHEEL_CACHE, WHEEL_CACHE.with_name(WHEEL_CACHE.name + "-dist")
    script_env = {
        **env,
        "WHEELHOUSE": str(deps),
        "DIST": str(dist),
        "PYTHON": sys.executable,
        "TORCH_INDEX": os.environ.get("TORCH_INDEX", ""),
    }
    run([str(DOCKER_DIR / "wheelhouse.sh"), "--own-only"], script_env)
    offline = {k: v for k, v in env.items() if not k.startswith("PIP_")} | {
        "PIP_CONFIG_FILE": os.devnull
    }
    wheel = next(dist.glob("hydrafl-*.whl"))
    complete = (
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--no-index",
                "--quiet",
                "--find-links",
                str(deps),
                f"{wheel}[postgres]",
            ],
            offline,
            check=False,
        ).returncode
        == 0
    )
    if not complete:
        log(f"filling the wheelhouse {deps}")
        run([str(DOCKER_DIR / "wheelhouse.sh")], script_env)
    return deps, dist


def link_tree(source: Path, target: Path) -> None:
    try:
        shutil.copytree(source, target, copy_function=os.link)
    except OSError:  # another filesystem
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)


@pytest.fixture(scope="module")
def images(docker_env, tmp_path_factory):
    """Build the three images from a copy of docker/ with the cached wheelhouse; returns the proxy-CA marker."""
    client, env = docker_env
    started = time.monotonic()
    deps, dist = wheelhouse(env)
    log(f"wheelhouse ready in {time.monotonic() - started:.0f} s")
    context = tmp_path_factory.mktemp("build") / "docker"
    shutil.copytree(DOCKER_DIR, context, ignore=shutil.ignore_patterns("wheelhouse", "dist"))
    link_tree(deps, context / "wheelhouse")
    link_tree(dist, context / "dist")
    marker = f"HYDRAFL-TEST-PROXY-CA-{secrets.token_hex(8)}"
    proxy_ca = context.parent / "proxy-ca.pem"
    proxy_ca.write_text(f"-----BEGIN CERTIFICATE-----\n{marker}\n-----END CERTIFICATE-----\n")
    build_env = {**env, "DOCKER": client, "HYDRAFL_BUILD_CA": str(proxy_ca)}
    built = time.monotonic()
    run([str(context / "build.sh")], build_env, timeout=2400)
    log(f"images built in {time.monotonic() - built:.0f} s")
    return marker


def compose(
    env: dict[str, str], project: str, *args: str, check: bool = True, timeout: float = 900
):
    return run(
        ["docker-compose", "-p", project, "-f", str(DOCKER_DIR / "compose.yaml"), *args],
        env,
        timeout=timeout,
        check=check,
    )


def scan_images(client: str, env: dict[str, str], needles: list[str]) -> list[str]:
    """Which needles occur in the images' layers (`docker save`, streamed) or their history."""
    found = set()
    history = "".join(run([client, "history", "--no-trunc", image], env).stdout for image in IMAGES)
    found |= {needle for needle in needles if needle in history}
    encoded = [needle.encode() for needle in needles]
    overlap = max(map(len, encoded))
    with subprocess.Popen([client, "save", *IMAGES], env=env, stdout=subprocess.PIPE) as save:
        tail = b""
        while chunk := save.stdout.read(1 << 24):
            window = tail + chunk
            found |= {needle.decode() for needle in encoded if needle in window}
            tail = window[-overlap:]
    assert save.returncode == 0, "docker save failed"
    return sorted(found)


def test_compose_runs_a_federated_job_to_the_end(docker_env, images):
    client, env = docker_env
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is missing: apt-get install docker-compose")
    marker = images
    project = f"hydrafl-e2e-{os.getpid()}"
    password = secrets.token_urlsafe(16)
    env = {
        **env,
        "HYDRAFL_PUBLISH": "127.0.0.1:0",
        "HYDRAFL_DB_PASSWORD": password,
        "HYDRAFL_DEMO_ROUNDS": str(ROUNDS),
    }
    started = time.monotonic()
    try:
        up = compose(env, project, "up", "-d", check=False)
        if up.returncode != 0:  # e.g. an unhealthy coordinator: what it said is the diagnosis
            logs = compose(env, project, "logs", "--no-color", "--tail=60", check=False).stdout
            pytest.fail(f"compose up exited {up.returncode}:\n{up.stderr[-2000:]}\n{logs[-6000:]}")
        log(f"compose up in {time.monotonic() - started:.0f} s")
        status: dict = {}
        deadline = time.monotonic() + RUN_DEADLINE_S
        while time.monotonic() < deadline:
            reply = compose(
                env,
                project,
                "exec",
                "-T",
                "coordinator",
                "hydrafl",
                "admin",
                "run",
                "status",
                "1",
                "--json",
                "--db",
                DB_URL,
                check=False,
                timeout=120,
            )
            if reply.returncode == 0:
                status = json.loads(reply.stdout)
                if status["status"] in ("finished", "failed", "cancelled"):
                    break
            time.sleep(5)
        log(f"run 1 {status.get('status')} {time.monotonic() - started:.0f} s after compose up")
        logs = compose(env, project, "logs", "--no-color", "--tail=40", check=False).stdout
        assert status.get("status") == "finished", f"run 1: {status}\n{logs[-6000:]}"
        assert status["rounds_done"] == status["rounds"] == ROUNDS
        assert status["history"][-1]["sites_ok"] == len(SITES)

        def container(service: str) -> str:
            return compose(env, project, "ps", "-q", service).stdout.strip()

        coordinator = container("coordinator")
        health = run(
            [client, "inspect", "-f", "{{.State.Health.Status}}", coordinator], env
        ).stdout.strip()
        assert health == "healthy", logs[-3000:]
        # Killed and started again as the same container (same hostname, pid 1), the coordinator takes its own
        # lease at once: it serves well before the lease would go stale (30 s), and never exits in between.
        run([client, "kill", coordinator], env)
        run([client, "start", coordinator], env)
        restarted, serving = time.monotonic(), None
        while serving is None or (serving.returncode != 0 and time.monotonic() - restarted < 25):
            time.sleep(1)
            serving = run(
                [client, "exec", coordinator, "python", "/opt/hydrafl/bin/hydrafl-healthcheck"],
                env,
                check=False,
                timeout=60,
            )
        own_lease_s = time.monotonic() - restarted
        restarted_logs = run([client, "logs", "--tail=30", coordinator], env, check=False)
        log(f"the restarted coordinator served {own_lease_s:.0f} s after docker start")
        assert serving.returncode == 0, (
            f"not serving {own_lease_s:.0f} s after a restart:\n{restarted_logs.stderr[-3000:]}"
        )
        assert "another coordinator" not in restarted_logs.stdout + restarted_logs.stderr
        for service in ("postgres", "coordinator", *SITES):
            uid = run([client, "exec", container(service), "id", "-u"], env).stdout.strip()
            assert uid != "0", f"{service} runs as root"
        for image in IMAGES:
            user = run(
                [client, "image", "inspect", "-f", "{{.Config.User}}", image], env
            ).stdout.strip()
            assert user not in ("", "0", "root"), f"{image} has no non-root USER"

        tokens = {}
        for site in SITES:
            site_id = container(site)
            listing = run([client, "exec", site_id, "ls", "-A", "/run/secrets"], env).stdout.split()
            assert listing == ["site-token"], f"{site} sees {listing}"
            tokens[site] = run(
                [client, "exec", site_id, "cat", "/run/secrets/site-token"], env
            ).stdout.strip()
            # Sites share a network with the coordinator only, never with the database.
            probe = run(
                [
                    client,
                    "exec",
                    site_id,
                    "python",
                    "-c",
                    "import socket; socket.getaddrinfo('postgres', 5432)",
                ],
                env,
                check=False,
            )
            assert probe.returncode != 0, f"{site} can resolve the database"
        assert len(set(tokens.values())) == len(SITES) and all(
            len(token) >= 20 for token in tokens.values()
        )

        scanned = time.monotonic()
        present = 'SERVICE = "hydrafl.proto.Coordinator"'  # healthcheck.py's: proves the scan reads the layers
        found = scan_images(client, env, [*tokens.values(), marker, password, present])
        log(f"scanned the images in {time.monotonic() - scanned:.0f} s")
        assert found == [present], f"secrets in the images: {sorted(set(found) - {present})}"
    finally:
        compose(env, project, "down", "-v", "--remove-orphans", check=False)
        log(f"compose test done in {time.monotonic() - started:.0f} s")
