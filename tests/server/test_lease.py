"""One coordinator per database and per port: the database lease (fresh refused, stale taken over, racing
acquisitions, heartbeat, loss), on SQLite and PostgreSQL, and real `hydrafl server` processes refused."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from deployment import free_port, wait_serving
from helpers import SMALL_RUN
from sqlalchemy import create_engine

from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator
from hydrafl.server.lease import LeaseClaim, LeaseHeld, lease_age_s
from hydrafl.server.lease_keeper import LeaseLost
from hydrafl.server.store import Store
from hydrafl.server.tables import CoordinatorLease


def _claim(holder: str, stale_s: float = 30.0, pid: int = 1, host: str = "ward-7") -> LeaseClaim:
    return LeaseClaim(
        holder=holder, host=host, pid=pid, listen=f"10.0.0.{pid}:9091", stale_s=stale_s
    )


def test_a_fresh_lease_refuses_others_and_a_stale_one_is_taken_over_once(db_url):
    store = Store(db_url)
    assert store.acquire_lease(_claim("a" * 32, stale_s=0.5, pid=11)) is None
    # from another host, so whether a pid 11 runs here says nothing about the holder: only staleness counts
    with pytest.raises(
        LeaseHeld,
        match=r"ward-7 pid 11, listening on 10\.0\.0\.11:9091, last heartbeat 0\.\d s ago",
    ):
        store.acquire_lease(_claim("b" * 32, pid=12, host="ward-8"))
    time.sleep(0.6)
    taken_from = store.acquire_lease(_claim("b" * 32, pid=12, host="ward-8"))
    assert (taken_from.holder, taken_from.pid) == ("a" * 32, 11)
    assert store.lease().holder == "b" * 32
    [event] = store.audit_events("lease-taken-over")
    assert "ward-7 pid 11, listening on 10.0.0.11:9091" in event.detail and "a" * 32 in event.detail
    assert store.renew_lease("a" * 32) is False  # the old holder learns it lost the lease
    assert store.renew_lease("b" * 32) is True
    store.release_lease("a" * 32)  # only the holder's own release counts
    assert store.lease().holder == "b" * 32
    store.release_lease("b" * 32)
    assert store.lease() is None
    assert (
        store.acquire_lease(_claim("c" * 32)) is None
    )  # released: free at once, nothing taken over
    assert len(store.audit_events("lease-taken-over")) == 1


@pytest.mark.parametrize("stale_before", [False, True], ids=["free", "stale"])
def test_coordinators_racing_for_the_lease_exactly_one_wins(db_url, stale_before):
    """Separate engines, as separate processes would have, released together by a barrier; five times over."""
    setup = Store(db_url)
    for attempt in range(5):
        if (previous := setup.lease()) is not None:
            setup.release_lease(previous.holder)
        if stale_before:
            setup.acquire_lease(
                _claim(f"stale{attempt:027d}", stale_s=0.05)
            )  # never a contender's holder id
            time.sleep(0.1)
        stores = [Store(db_url) for _ in range(4)]
        barrier = threading.Barrier(len(stores))
        outcomes: dict[int, str] = {}

        def contend(
            index: int,
            stores: list[Store] = stores,
            barrier: threading.Barrier = barrier,
            outcomes: dict[int, str] = outcomes,
        ) -> None:  # this attempt's
            barrier.wait()
            try:
                stores[index].acquire_lease(_claim(f"{index:x}" * 32, pid=index))
                outcomes[index] = "won"
            except LeaseHeld as error:
                outcomes[index] = str(error)

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(stores))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == list(
            range(len(stores))
        )  # each one either won or was told who did
        winners = [index for index, outcome in outcomes.items() if outcome == "won"]
        assert len(winners) == 1, outcomes
        assert setup.lease().pid == winners[0]
        for index, outcome in outcomes.items():
            if index != winners[0]:
                assert f"pid {winners[0]}, listening on 10.0.0.{winners[0]}:9091" in outcome
    assert len(setup.audit_events("lease-taken-over")) == (5 if stale_before else 0)


def test_a_running_coordinator_heartbeats_and_releases_at_stop(db_url, tmp_path):
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            db_url=db_url,
            blob_dir=tmp_path / "blobs",
            runs_dir=tmp_path / "runs",
            lease_stale_s=0.6,
        )
    )
    coordinator.start()
    try:
        time.sleep(
            1.0
        )  # past the stale threshold: only the heartbeats (every 0.1 s) keep the lease fresh
        other = Store(db_url)
        assert lease_age_s(other.lease()) < 0.4
        with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}, listening on 127.0.0.1:0"):
            other.acquire_lease(_claim("e" * 32))
    finally:
        coordinator.stop()
    assert Store(db_url).lease() is None


def test_a_coordinator_whose_lease_was_taken_over_stops_driving_runs_loudly(tmp_path, caplog):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db_url)
    config = SMALL_RUN.replace(
        sites=2, samples_per_site=400, rounds=1, local_steps=10, batch_size=32, lr=2e-3
    )
    run = store.create_run(
        {k: v for k, v in config.to_flower().items() if k not in ("run-dir", "resume")}
    )
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            db_url=db_url,
            blob_dir=tmp_path / "blobs",
            runs_dir=tmp_path / "runs",
            lease_stale_s=0.6,
        )
    )
    coordinator.start()
    raised: list[BaseException] = []
    driver = threading.Thread(target=lambda: _record_error(coordinator.serve_forever, raised))
    driver.start()
    deadline = time.monotonic() + 30
    while store.run(run.id).status != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.run(run.id).status == "running"  # waiting for its two sites
    with store.session() as session, session.begin():
        session.get(CoordinatorLease, 1).holder = (
            "f" * 32
        )  # another coordinator took it while this one stalled
    driver.join(timeout=10)
    coordinator.stop()
    assert not driver.is_alive() and len(raised) == 1 and isinstance(raised[0], LeaseLost)
    assert any(
        r.levelno == logging.ERROR and "LEASE LOST" in r.getMessage() for r in caplog.records
    )
    assert store.run(run.id).status == "running"  # left for the new holder to resume, not failed
    assert [e.kind for e in store.audit_events() if e.run_id == run.id] == ["run-running"]
    assert (
        store.lease().holder == "f" * 32
    )  # stopping did not release the other coordinator's lease


def test_a_failing_heartbeat_is_logged_and_retried_without_giving_the_run_up(tmp_path, caplog):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0",
            db_url=db_url,
            blob_dir=tmp_path / "blobs",
            runs_dir=tmp_path / "runs",
            lease_stale_s=0.6,
        )
    )
    coordinator.start()
    CoordinatorLease.__table__.drop(
        create_engine(db_url)
    )  # every renewal now fails in the database
    time.sleep(0.5)
    assert not coordinator.lease.lost.is_set()
    coordinator.lease.check()  # still driving: a failed renewal is not a lost lease
    coordinator.stop()
    failures = [r for r in caplog.records if "coordinator lease heartbeat failed" in r.getMessage()]
    assert len(failures) >= 2 and all(r.levelno == logging.WARNING for r in failures)
    assert "no such table: coordinator_lease" in failures[0].getMessage()
    assert any("could not release the coordinator lease" in r.getMessage() for r in caplog.records)


def _record_error(function, errors: list[BaseException]) -> None:
    try:
        function()
    except BaseException as error:
        errors.append(error)


def _server(tmp_path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "HYDRAFL_HOME": str(tmp_path / "home")}
    return subprocess.Popen(
        [sys.executable, "-m", "hydrafl", "server", "--blobs", str(tmp_path / "blobs"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _error_line(stderr: str) -> str:
    [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
    return line


@pytest.mark.slow
def test_a_second_server_on_the_same_database_or_the_same_port_refuses_to_start(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    address = f"127.0.0.1:{free_port()}"
    first = Coordinator(
        CoordinatorConfig(
            listen=address, db_url=db_url, blob_dir=tmp_path / "blobs", runs_dir=tmp_path / "runs"
        )
    )
    first.start()
    try:
        other_db = f"sqlite:///{tmp_path / 'other.db'}"
        same_db = _server(tmp_path, "--db", db_url, "--listen", f"127.0.0.1:{free_port()}")
        same_port = _server(tmp_path, "--db", other_db, "--listen", address)
        same_db_err, same_port_err = (
            same_db.communicate(timeout=60)[1],
            same_port.communicate(timeout=60)[1],
        )
    finally:
        first.stop()
    assert (same_db.returncode, same_port.returncode) == (2, 2)
    refusal = _error_line(same_db_err)
    assert (
        f"another coordinator holds this database: {socket.gethostname()} pid {os.getpid()}, "
        in refusal
    )
    assert f"listening on {address}, last heartbeat " in refusal
    wait_s = int(re.search(r"Stop it, or wait (\d+) s if it died", refusal).group(1))
    assert 20 <= wait_s <= 30
    assert (
        _error_line(same_port_err)
        == f"error: cannot listen on {address}: the address is in use (another coordinator?)"
    )
    assert Store(other_db).lease() is None  # refused before it touched its database's lease


@pytest.mark.slow
def test_after_kill_9_a_new_server_takes_the_stale_lease_over_and_sigterm_releases_it(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    address = f"127.0.0.1:{free_port()}"
    first = _server(tmp_path, "--db", db_url, "--listen", address, "--lease-stale-s", "2")
    wait_serving(address, process=first)
    store = Store(db_url)
    assert store.lease().pid == first.pid
    first.send_signal(signal.SIGKILL)
    first.communicate()
    deadline = time.monotonic() + 10
    while lease_age_s(store.lease()) <= 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    second = _server(tmp_path, "--db", db_url, "--listen", address, "--lease-stale-s", "2")
    try:
        wait_serving(address, process=second)
        assert store.lease().pid == second.pid
        [event] = store.audit_events("lease-taken-over")
        assert f"pid {first.pid}, listening on {address}, last heartbeat" in event.detail
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    finally:
        second.kill()
        second.communicate()
    assert store.lease() is None


def _pretend_pid(db_url: str, pid: int) -> None:
    """The lease row as a coordinator restarted in the same container writes it: docker's pid 1 is every
    incarnation's pid (this test's own pid stands in for it)."""
    engine = create_engine(db_url)
    with engine.begin() as connection:
        connection.execute(CoordinatorLease.__table__.update().values(pid=pid))
    engine.dispose()


@pytest.mark.slow
def test_a_coordinator_restarted_with_the_same_host_and_pid_takes_its_own_lease_and_a_live_one_is_refused(
    tmp_path,
):
    """Same hostname, same pid, fresh heartbeat: while the coordinator that wrote the lease lives (it holds its
    state folder), a second one on that folder is refused; once it is killed -9, the restart takes the lease at
    once instead of waiting the 30 s for it to go stale."""
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    home = tmp_path / "home"
    config = CoordinatorConfig(
        listen="127.0.0.1:0",
        db_url=db_url,
        home=home,
        blob_dir=tmp_path / "blobs",
        runs_dir=tmp_path / "runs",
    )
    address = f"127.0.0.1:{free_port()}"
    first = _server(tmp_path, "--db", db_url, "--listen", address)  # HYDRAFL_HOME is `home`
    try:
        wait_serving(address, process=first)
        store = Store(db_url)
        held = store.lease()
        _pretend_pid(db_url, os.getpid())
        with pytest.raises(
            LeaseHeld, match=f"{socket.gethostname()} pid {os.getpid()}, listening on {address}"
        ):
            Coordinator(
                config
            ).start()  # the same host and pid, but the first is alive: another coordinator
        first.send_signal(signal.SIGKILL)
        first.communicate()
        assert lease_age_s(store.lease()) < 5  # fresh: only knowing itself lets the restart in now
        (
            tmp_path / "other-home"
        ).mkdir()  # another container: the same hostname and pid 1, its own volume
        with pytest.raises(LeaseHeld, match="wait (2\\d|30) s if it died"):  # 29.6 s prints as 30
            Coordinator(dataclasses.replace(config, home=tmp_path / "other-home")).start()
        restarted = Coordinator(config)
        restarted.start()
        try:
            assert store.lease().holder == restarted.lease.claim.holder != held.holder
            [event] = store.audit_events("lease-taken-over")
            assert held.holder in event.detail
        finally:
            restarted.stop()
        assert store.lease() is None
    finally:
        first.kill()
        first.communicate()


def _pid_one_server(tmp_path, home, *args: str) -> subprocess.Popen:
    """`hydrafl server` as pid 1 of its own pid namespace, as in a container: every start has the same hostname
    and pid 1. SIGKILL to the returned process kills the server too (`--kill-child`), as `docker kill` does."""
    env = {**os.environ, "HYDRAFL_HOME": str(home)}
    command = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        sys.executable,
        "-m",
        "hydrafl",
        "server",
        "--blobs",
        str(tmp_path / "blobs"),
        *args,
    ]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_a_coordinator_killed_and_restarted_as_pid_1_takes_its_own_lease_at_once(tmp_path):
    if subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    ).returncode:
        pytest.skip("no pid namespaces here (unshare needs root)")
    db_url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    home, other_home = tmp_path / "home", tmp_path / "other-home"
    address = f"127.0.0.1:{free_port()}"
    first = _pid_one_server(tmp_path, home, "--db", db_url, "--listen", address)
    try:
        wait_serving(address, process=first)
        store = Store(db_url)
        held = store.lease()
        assert (held.host, held.pid) == (socket.gethostname(), 1)
        for folder in (
            other_home,
            home,
        ):  # another container (its own volume), and one on this one: both live
            second = _pid_one_server(
                tmp_path, folder, "--db", db_url, "--listen", f"127.0.0.1:{free_port()}"
            )
            assert second.wait(timeout=60) == 2
            assert (
                f"another coordinator holds this database: {socket.gethostname()} pid 1, "
                in second.stderr.read()
            )
        first.send_signal(signal.SIGKILL)
        first.communicate()
        restarted = _pid_one_server(tmp_path, home, "--db", db_url, "--listen", address)
        try:
            wait_serving(address, timeout_s=30, process=restarted)
            lease = store.lease()
            assert lease.pid == 1 and lease.holder != held.holder and lease_age_s(lease) < 5
            [event] = store.audit_events("lease-taken-over")
            assert held.holder in event.detail
        finally:
            restarted.kill()
            restarted.communicate()
    finally:
        first.kill()
        first.communicate()
