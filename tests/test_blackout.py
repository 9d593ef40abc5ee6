"""The driver's own network problem, without processes: when every heartbeat stops
at once, nobody is evicted for it while the network may come back (blackout.py)."""

import dataclasses

from support.decide_world import World

from elastic.runner.blackout import NETWORK_WAIT_S, NetworkQuiet
from elastic.runner.decisions import Evict, HostFailed, Limits


def _silence(world, at):
    for wid in world.workers:
        world.ready(wid, at=at)


def _kinds(actions):
    return [type(a).__name__ for a in actions]


def test_every_beat_stopping_at_once_evicts_nobody_until_the_network_returns():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, worker_timeout=10))
    world.running()
    _silence(world, at=100.0)
    actions = world.tick(112.0, liveness=True)              # past --worker-timeout for both
    assert [type(a) for a in actions] == [NetworkQuiet], actions
    assert "network looks down" in actions[0].line
    assert world.tick(150.0, liveness=True) == []            # one warning, still nobody evicted
    # The network comes back at 160: worker 0 beats first, worker 1 a tick later.
    world.ready("0", at=160.0)
    actions = world.tick(160.0, liveness=True)
    assert [type(a) for a in actions] == [NetworkQuiet] and actions[0].since is None, actions
    assert "back" in actions[0].line
    assert world.tick(165.0, liveness=True) == []            # worker 1 gets a full timeout
    world.ready("1", at=165.5)
    world.ready("0", at=170.0)
    assert world.tick(171.0, liveness=True) == []
    assert world.hosts.blacklisted(171.0) == ()


def test_one_worker_silent_after_the_outage_is_evicted_a_timeout_later():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, worker_timeout=10))
    world.running()
    _silence(world, at=100.0)
    world.tick(112.0, liveness=True)
    world.ready("0", at=130.0)
    world.tick(130.0, liveness=True)                          # back at 130
    world.ready("0", at=138.0)
    assert world.tick(139.0, liveness=True) == []
    world.ready("0", at=141.0)
    actions = world.tick(141.0, liveness=True)
    assert Evict("1", "b") in actions
    assert any(isinstance(a, HostFailed) and a.host == "b" for a in actions)


def test_the_wait_is_bounded_then_silence_evicts_as_usual():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, worker_timeout=10))
    world.running()
    _silence(world, at=100.0)
    world.tick(112.0, liveness=True)
    actions = world.tick(100.0 + NETWORK_WAIT_S + 1, liveness=True)
    assert isinstance(actions[0], NetworkQuiet) and "did not come back" in actions[0].line
    assert Evict("0", "a") in actions and Evict("1", "b") in actions


def test_silences_that_began_apart_are_not_the_drivers_network():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, worker_timeout=10))
    world.running()
    world.ready("0", at=100.0)
    world.ready("1", at=106.0)                               # 6 s apart: two separate failures
    actions = world.tick(111.0, liveness=True)
    assert Evict("0", "a") in actions
    assert not any(isinstance(a, NetworkQuiet) for a in actions)


def test_a_single_host_going_silent_is_that_hosts_problem():
    world = World({"a": 2}, Limits(np=2, min_np=1, worker_timeout=10))
    world.running()
    _silence(world, at=100.0)
    actions = world.tick(111.0, liveness=True)
    assert not any(isinstance(a, NetworkQuiet) for a in actions)
    assert Evict("0", "a") in actions


def test_a_worker_that_got_sigterm_is_not_watched():
    world = World({"a": 1, "b": 1, "c": 1}, Limits(np=3, min_np=1, worker_timeout=10))
    world.running()
    _silence(world, at=100.0)
    # Worker 2 got SIGTERM (its leave is being handled): only 0 and 1 are watched.
    world.workers["2"] = dataclasses.replace(world.workers["2"], leaving_since=111.0)
    actions = world.tick(112.0, liveness=True)
    assert _kinds(actions)[:1] == ["NetworkQuiet"], actions
    assert not any(isinstance(a, Evict) and a.worker_id in ("0", "1") for a in actions)


def test_a_short_worker_timeout_still_evicts_one_silent_worker_and_sees_a_real_blackout():
    """--worker-timeout 1.5: workers beat every 0.15 s, so live workers' last beats are
    always within a fraction of a second of each other. One SIGSTOPped worker must be
    evicted, and everyone silent at once must still read as the driver's network."""
    limits = Limits(np=2, min_np=1, worker_timeout=1.5)
    world = World({"a": 1, "b": 1}, limits)
    world.running()
    t = 100.0
    world.ready(at=t)
    for _ in range(20):                       # worker 1 stops at 100; worker 0 beats on
        t += 0.15
        world.ready("0", at=t)
        actions = world.tick(t, liveness=True)
        assert not any(isinstance(a, NetworkQuiet) for a in actions), (t, actions)
        if Evict("1", "b") in actions:
            break
    assert Evict("1", "b") in actions and t < 100.0 + 2 * 1.5, (t, actions)
    blackout = World({"a": 1, "b": 1}, limits)
    blackout.running()
    _silence(blackout, at=200.0)
    actions = blackout.tick(201.4, liveness=True)            # past the timeout for both
    assert [type(a) for a in actions] == [NetworkQuiet], actions
