"""The round protocol's pieces, on a real TCPStore: the header's id runs, chunked
reads of many keys, and the driver's side of a round's assembly."""

import random
import secrets

import pytest

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys
from elastic.runner.control_plane import DriverControl


def test_id_runs_hold_exactly_the_members():
    rng = random.Random(7)
    for _ in range(300):
        ids = {str(i) for i in rng.sample(range(2000), rng.randint(0, 300))}
        ids |= {f"w{i}" for i in range(rng.randint(0, 3))}      # ids a test harness uses
        encoded = control.encode_ids(ids)
        assert sorted(control.decode_ids(encoded)) == sorted(ids)
        for probe in [*map(str, range(-1, 2002, 7)), "w0", "w9", "x"]:
            assert control.ids_contain(encoded, probe) == (probe in ids), (probe, encoded)


def test_consecutive_ids_are_one_run_whatever_the_size():
    assert control.encode_ids(map(str, range(4096))) == [[0, 4096]]
    # A replaced worker gets a new id: one more run, not one more entry per member.
    ids = [str(i) for i in range(4096) if i != 17] + ["4096"]
    assert control.encode_ids(ids) == [[0, 17], [18, 4079]]


def test_poll_pause_keeps_small_jobs_quick_and_bounds_the_store_load():
    assert control.poll_pause(4, 0.0) == 0.005
    assert control.poll_pause(4, 10.0) == 0.1
    big = control.poll_pause(4096, 0.0)
    assert 4096 / big <= control.STORE_LOOKS_PER_S * 1.0001


def test_backstop_looks_stay_at_half_a_second_in_small_rounds_and_slow_in_big_ones():
    assert control.backstop_pause(4) == control.backstop_pause(1000) == 0.5
    assert control.backstop_pause(4096) > 2.0
    assert 4096 / control.backstop_pause(4096) <= control.BACKSTOP_LOOKS_PER_S * 1.0001


@pytest.fixture
def store():
    master = control.listen("127.0.0.1", 30)
    yield master
    del master


def test_get_present_reads_many_keys_in_few_round_trips(store):
    cs = ControlStore(store, secrets.token_hex(16))
    keys = [f"k/{i}" for i in range(2000)]
    missing = {keys[5], keys[600], keys[1999]}
    cs.put_many({k: {"i": i} for i, k in enumerate(keys) if k not in missing})
    cs.raw.set(keys[700], b"forged")                 # present but not sealed: left out
    before = cs.requests
    found = cs.get_present(keys)
    assert set(found) == set(keys) - missing - {keys[700]}
    assert all(found[k] == {"i": keys.index(k)} for k in list(found)[:50])
    # 4 chunks; a chunk with a missing key is halved down to 32 keys, then read key by
    # key: about 80 requests for each of the 3 such chunks, not 2 per key.
    assert cs.requests - before < 300, cs.requests - before


def _driver_and_worker(n):
    """A driver's control plane, a worker's connection to it, and n members on one host."""
    secret = secrets.token_hex(16)
    plane = DriverControl({"localhost": n}, {"localhost"}, secret)
    worker = ControlStore(control.connect("127.0.0.1", plane.port, 30), secret)
    members = [control.Member(str(i), "localhost", rank=i, size=n, local_rank=i, local_size=n,
                              cross_rank=0, cross_size=1) for i in range(n)]
    return plane, worker, members


def _arrive(worker_store, round_id, wid, ring=True):
    """What a member does: its sealed arrival, then the round's doorbell."""
    worker_store.put(Keys.joined(round_id, wid), {"round": round_id})
    if ring:
        control.Doorbell(worker_store, Keys.arrivals(round_id)).ring(wid)


def eventually(read, want, timeout=30.0):
    """What ``read`` returns once it returns ``want``: a TCPStore set is not
    acknowledged, so another connection sees it a moment later (one connection's
    own requests stay in order, which is what the protocol relies on)."""
    import time
    deadline = time.monotonic() + timeout
    value = read()
    while value != want and time.monotonic() < deadline:
        time.sleep(0.005)
        value = read()
    return value


def test_the_driver_says_assembled_once_every_member_arrived():
    plane, worker, members = _driver_and_worker(3)
    plane.publish(1, members)
    assert eventually(lambda: worker.get(Keys.LATEST_ROUND), {"round": 1}) == {"round": 1}
    # The wire format, as JSON (the typed values of protocol.py do not change it).
    assert worker.get(Keys.plan(1)) == {"round": 1, "size": 3, "ids": [[0, 3]]}
    assert worker.get(Keys.member(1, "1")) == {
        "worker_id": "1", "host": "localhost", "rank": 1, "size": 3, "local_rank": 1,
        "local_size": 3, "cross_rank": 0, "cross_size": 1}
    assert plane.assembly(1) == 0
    _arrive(worker, 1, "0")
    _arrive(worker, 1, "2")
    assert eventually(lambda: plane.assembly(1), 2) == 2
    assert worker.get(Keys.assembled(1)) is None
    _arrive(worker, 1, "1")
    assert eventually(lambda: plane.assembly(1), 3) == 3
    assert eventually(lambda: worker.get(Keys.assembled(1)), {"round": 1, "ok": True}) == \
        {"round": 1, "ok": True}
    assert plane.assembly(1) is None          # nothing is read once it assembled


def test_an_abort_before_assembly_releases_the_waiting_members():
    plane, worker, members = _driver_and_worker(2)
    plane.publish(1, members)
    _arrive(worker, 1, "0")
    assert eventually(lambda: plane.assembly(1), 1) == 1
    plane.abort(1)
    assert eventually(lambda: worker.get(Keys.assembled(1)), {"round": 1, "ok": False}) == \
        {"round": 1, "ok": False}
    assert worker.has(Keys.abort(1))
    # A round replaced before it assembled says so too.
    plane.publish(2, members)
    plane.publish(3, members[:1])
    assert eventually(lambda: worker.get(Keys.LATEST_ROUND), {"round": 3}) == {"round": 3}
    assert worker.get(Keys.assembled(2)) == {"round": 2, "ok": False}
    assert worker.get(Keys.plan(3))["size"] == 1


def test_keys_of_old_rounds_and_reaped_workers_leave_the_store():
    import time

    from elastic.runner.control_plane import ROUND_KEYS_KEPT
    plane, worker, members = _driver_and_worker(2)
    for r in range(1, ROUND_KEYS_KEPT + 3):
        plane.publish(r, members)
        for m in members:
            _arrive(worker, r, m.worker_id)
        assert eventually(lambda r=r: plane.assembly(r), 2) == 2
    worker.put(Keys.heartbeat("1"), {"beat": 1})
    plane.worker_gone("1")
    assert eventually(lambda: worker.present(Keys.heartbeat("1")), True)
    for r in range(ROUND_KEYS_KEPT + 3, 2 * ROUND_KEYS_KEPT + 4):   # its keys go later
        plane.publish(r, members)
    old = [Keys.plan(1), Keys.member(1, "0"), Keys.joined(1, "1"), Keys.assembled(2),
           Keys.heartbeat("1")]
    deadline = time.monotonic() + 30
    while any(worker.present(k) for k in old) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(worker.present(k) for k in old)
    r = 2 * ROUND_KEYS_KEPT + 3                 # the newest rounds are all still there
    assert eventually(lambda: worker.get(Keys.LATEST_ROUND), {"round": r}) == {"round": r}
    assert worker.get(Keys.plan(r))["size"] == 2 and worker.has(Keys.member(r - 1, "1"))


def test_a_wiped_doorbell_only_delays_an_arrival_to_the_next_full_look():
    from elastic.runner.control_plane import FULL_LOOK_S
    plane, worker, members = _driver_and_worker(2)
    plane.publish(1, members)
    t = 1e9                                        # the driver's clock, given explicitly
    _arrive(worker, 1, "0")
    assert eventually(lambda: plane.assembly(1, t), 1) == 1       # rung: seen at once
    _arrive(worker, 1, "1", ring=False)            # an outsider wiped the bell
    worker.raw.set(Keys.arrivals(1), b"666\nnot a worker\n")     # ... and rang false names
    assert eventually(lambda: worker.present(Keys.joined(1, "1")), True)
    assert plane.assembly(1, t + FULL_LOOK_S / 2) == 1            # not rung: not looked at
    assert plane.assembly(1, t + FULL_LOOK_S * 2) == 2            # the full look finds it


def test_no_full_look_while_verified_arrivals_stream_in_and_one_once_they_stop():
    """A full look reads every awaited key (thousands in a big round): it waits until
    the doorbell has brought no verified name for FULL_LOOK_S."""
    from elastic.runner.control_plane import FULL_LOOK_S
    plane, worker, members = _driver_and_worker(3)
    plane.publish(1, members)
    t = 1e9
    _arrive(worker, 1, "0")
    assert eventually(lambda: plane.assembly(1, t), 1) == 1
    _arrive(worker, 1, "1", ring=False)            # its ring was lost (a wiped bell)
    _arrive(worker, 1, "2")
    assert eventually(lambda: plane.assembly(1, t + 0.9 * FULL_LOOK_S), 2) == 2
    assert plane.assembly(1, t + 1.5 * FULL_LOOK_S) == 2          # rung 0.6 periods ago
    worker.raw.set(Keys.arrivals(1), b"0\n2\n0\n2\n1x\n")         # false and stale names
    assert plane.assembly(1, t + 1.8 * FULL_LOOK_S) == 2          # ... do not postpone it
    assert plane.assembly(1, t + 2.0 * FULL_LOOK_S) == 3          # quiet for a period


def _member(conn, round_id, size):
    """What RoundLifeCycle.round_aborted reads of a worker: its round, its size and the
    driver's news (a not-patient DriverContact reads the control connection)."""
    from elastic.worker.rounds import RoundLifeCycle

    class Member(RoundLifeCycle):
        def __init__(self):
            self._init_rounds(size)
            self.control, self.round_id = conn, round_id
            self.contact = type("Contact", (), {"news": staticmethod(conn.get)})()
    return Member()


def test_a_members_failure_report_ends_a_small_rounds_waits_before_the_drivers_abort():
    from elastic.worker import runtime
    from elastic.worker.rounds import SELF_ASSEMBLY_MAX
    plane, conn, members = _driver_and_worker(3)
    plane.publish(1, members)
    small, big = _member(conn, 1, 3), _member(conn, 1, SELF_ASSEMBLY_MAX + 1)
    assert not small.round_aborted() and not big.round_aborted()
    conn.raw.set(Keys.failures(1), b"forged")             # an outsider's write: ignored
    assert not small.round_aborted()
    # A member that saw a collective fail reports it (Worker.report_failure) and leaves.
    reporter = type("Reporter", (), {"round_id": 1, "over_round": 0, "worker_id": "2",
                                     "control": conn, "_standing": set()})()
    runtime.Worker.report_failure(reporter, "Connection closed by peer")
    assert eventually(small.round_aborted, True) is True and small.over_round == 1
    assert not big.round_aborted()  # a big round waits for the driver (a look fewer per slice)
    # The member that gave up its wait saw no failure itself: it reports none, so the
    # driver's verdict counts only the member that saw one.
    runtime.Worker.report_failure(small, "allreduce abandoned")
    assert plane.failure_reports(1, [m.worker_id for m in members]).keys() == {"2"}
    plane.abort(1)
    assert eventually(big.round_aborted, True) is True
