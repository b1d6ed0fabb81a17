"""What a real import pulls in, each in a fresh interpreter: a site's process, and the coordinator's (with every
strategy loaded). A probe imports the whole stack it names (seconds each), so a session that will read one starts
them all once its tests are collected (`conftest.pytest_collection_finish`): they run in the background while
other tests run, and `loaded` waits for the one asked for."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBES = {
    "site": "import sys, hydrafl.client.site_app, hydrafl.client.agent\nprint(' '.join(sorted(sys.modules)))",
    "coordinator": (
        "import sys, hydrafl.server.coordinator, hydrafl.server.server_app, hydrafl.cli.server, hydrafl.cli.admin\n"
        "from hydrafl.strategies.registry import strategy_names\n"
        "strategy_names()\n"
        "print(' '.join(sorted(sys.modules)))"
    ),
}
_started: dict[str, subprocess.Popen] = {}


def start() -> None:
    """Start the probes not started yet; they run in the background."""
    for name, code in PROBES.items():
        if name not in _started:
            _started[name] = subprocess.Popen(
                [sys.executable, "-c", code],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )


@functools.cache
def loaded(name: str) -> tuple[str, ...]:
    """The modules probe `name`'s interpreter had loaded when it finished (started now if it was not)."""
    start()
    out, err = _started[name].communicate(timeout=300)
    assert _started[name].returncode == 0, err[-4000:]
    return tuple(out.split())


def stop() -> None:
    """End the probes still running (a session that ended before reading them)."""
    for process in _started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


CLI = """
import json, sys, time
started = time.perf_counter()
from hydrafl.cli import main
sys.argv = ["hydrafl", *json.loads(sys.argv[1])]
code = 0
try:
    main()
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "modules": sorted(sys.modules), "seconds": time.perf_counter() - started}))
"""


def cli(
    args: list[str], env: dict[str, str], cwd: Path | None = None
) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    """`hydrafl ARGS` in a fresh interpreter: its exit code, the modules it had loaded and the seconds it took
    (from its first import), with the finished process (stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", CLI, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done
