"""Ray started for Flower's simulation engine, with a retry where Ray's own start gives up too early.

Ray waits a fixed 30 s for its raylet to register; on a loaded 2-core machine that wait sometimes runs out
(seen once in a full test run here) and the run fails before any site trains. Flower's `RayBackend` starts Ray
only when it is not running yet, so starting it here first, with the same arguments, lets a timed-out start be
retried.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

ATTEMPTS = 3
_TIMED_OUT = "timed out during startup"
"""What Ray's start says when its raylet missed the wait (a plain Exception)."""


def start_ray(num_cpus: int) -> None:
    """Start a local Ray as Flower's RayBackend would (workers see this process's sys.path), retrying a start
    that timed out."""
    import ray

    if ray.is_initialized():  # a run that failed before Flower's backend could shut it down
        return
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["PYTHONPATH"] = pythonpath
    for attempt in range(1, ATTEMPTS + 1):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
            )
            return
        except Exception as error:  # Ray raises a plain Exception for a start that timed out
            ray.shutdown()
            if _TIMED_OUT not in str(error) or attempt == ATTEMPTS:
                raise
            log.warning(
                "Ray's start timed out (attempt %d of %d); starting it again", attempt, ATTEMPTS
            )
