"""`make scale`'s harness, small: the real driver and 12 simulated workers through a
join, a leave and a crash (no timing is asserted; make scale prints the figures)."""

import pytest

from benchmarks import scale


@pytest.mark.slow
def test_the_simulated_cluster_goes_through_a_join_a_leave_and_a_crash():
    row = scale.measure(12, steady_s=1.0, timeout=120, processes=2)
    # Every change ended in an assembled round of the right size.
    assert row["rounds"] == [12, 13, 12, 11], row
    for change, size in (("join", 13), ("leave", 12), ("crash", 11)):
        joins = row[f"{change}_joins"]
        assert joins is not None and joins["workers"] == size, (change, joins)
        # Each member read something to join, one small key per look: a look never
        # reads anything like the whole plan (how many looks depends on the load).
        assert joins["bytes_median"] > 0 and joins["requests_median"] > 0, (change, joins)
        per_look = joins["bytes_median"] / joins["requests_median"]
        assert per_look < row["plan_bytes_before"] / 2, (change, joins, row["plan_bytes_before"])
    # An idle driver may use less than one clock tick in the 1 s steady window.
    assert row["store_rps"] > 0 and row["driver_cpu"] >= 0


@pytest.mark.slow
def test_members_of_a_big_round_read_only_their_own_entry(monkeypatch, tmp_path):
    """Above SELF_ASSEMBLY_MAX a member's entry carries the round's size: members join
    the rounds of a join, a leave and a crash without reading their headers. Only a
    worker with no entry reads one: the newcomer asks whether it is in round 1, the
    removed worker whether it is in the leave's round (it is not: it leaves)."""
    import os

    from elastic.control_store import ControlStore
    from elastic.protocol import Keys
    from elastic.worker import rounds

    monkeypatch.setattr(rounds, "SELF_ASSEMBLY_MAX", 4)     # 12 workers: a big round
    reads = tmp_path / "header-reads"
    real_get = ControlStore.get
    headers = {Keys.plan(r) for r in range(2, 20)}

    def get(self, key):
        if key in headers:                 # the forked processes inherit this patch
            with open(reads, "a") as f:
                f.write(f"{os.getpid()} {key}\n")
        return real_get(self, key)

    monkeypatch.setattr(ControlStore, "get", get)
    row = scale.measure(12, steady_s=1.0, timeout=120, processes=2)
    assert row["rounds"] == [12, 13, 12, 11], row
    read = reads.read_text().split() if reads.exists() else []
    keys = read[1::2]
    # Rounds 2, 3, 4: the join's, the leave's and the crash's.
    assert keys.count(Keys.plan(2)) == 0 and keys.count(Keys.plan(4)) == 0, read
    assert keys.count(Keys.plan(3)) <= 1, read
    assert len(keys) == keys.count(Keys.plan(3)), read



def test_a_member_of_a_big_round_waits_a_pause_before_its_first_look_or_heal(monkeypatch):
    """After its arrival, a member of a big round neither looks for the driver's word
    nor heals its kept values for a pause: the arrivals of every other member are
    landing in the store then. A fake clock makes the order exact."""
    import types

    from benchmarks.scale_sim import SimWorker
    from elastic import protocol
    from elastic.control_store import ControlStore, listen
    from elastic.protocol import Keys
    from elastic.worker import rounds

    size, secret = 4096, "s" * 32
    server = listen("127.0.0.1", 30)
    env = {protocol.ENV_ADDR: "127.0.0.1", protocol.ENV_PORT: str(server.port),
           protocol.ENV_SECRET: secret, protocol.ENV_WORKER_ID: "7",
           protocol.ENV_SIZE: str(size)}
    driver = ControlStore(protocol.connect("127.0.0.1", server.port, 30), secret)
    driver.put(Keys.member(5, "7"), {"worker_id": "7", "host": "sim-7", "rank": 7,
                                     "size": size, "local_rank": 0, "local_size": 1,
                                     "cross_rank": 7, "cross_size": size})
    monkeypatch.setattr(rounds.Membership, "export", lambda self: None)   # keep os.environ
    w = SimWorker(env, [protocol.connect("127.0.0.1", server.port, 30)])
    w.learn_latest(5)                     # as the commit's collective tells it
    log, clock = [], [1000.0]

    def sleep(s):
        log.append(("sleep", round(s, 3)))
        clock[0] += s
        if len(log) > 3:                  # the driver answers after the first looks
            driver.put(Keys.assembled(5), {"round": 5, "ok": True})
    real_get, real_heal = w.control.get, w.control.heal
    monkeypatch.setattr(w.control, "get", lambda key: (log.append(("look", key)),
                                                       real_get(key))[1])
    monkeypatch.setattr(w.control, "heal", lambda: (log.append(("heal",)), real_heal())[1])
    monkeypatch.setattr(rounds, "time", types.SimpleNamespace(
        monotonic=lambda: clock[0], sleep=sleep))
    try:
        membership = w.join_next_round()
    finally:
        w.stop()
    assert (membership.rank, membership.size) == (7, size)
    pause = round(protocol.poll_pause(size, 0), 3)
    # Its own entry, then its arrival (a put and a ring), then nothing for a pause.
    assert log[:3] == [("look", Keys.member(5, "7")), ("sleep", pause),
                       ("look", Keys.assembled(5))], log
    heals = [i for i, e in enumerate(log) if e == ("heal",)]
    slept = [sum(e[1] for e in log[:i] if e[0] == "sleep") for i in heals]
    assert all(s >= protocol.backstop_pause(size) for s in slept), log


def test_the_simulated_cluster_has_every_method_of_a_launcher_backend():
    """The driver calls each of them (runner/interfaces.py); a method added there and not
    here ends the simulated driver at its first tick."""
    from elastic.runner.interfaces import LauncherBackend
    SimCluster = scale.scale_sim.SimCluster  # noqa: N806 - the class itself
    wanted = {n for n in vars(LauncherBackend) if not n.startswith("_")}
    assert wanted and wanted <= set(dir(SimCluster)), wanted - set(dir(SimCluster))
