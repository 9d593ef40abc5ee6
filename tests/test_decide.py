"""The driver's policy without processes: every branch of ``decide(facts, now)``.

Each test writes a tick's situation down as facts and checks the actions that
come back. ``World`` (tests/support/decide_world.py) plays the driver: it carries actions
out on plain records (no processes, no store) and folds them into the job with ``evolve``.
"""

import copy
import dataclasses

from support.decide_world import World, kinds

from elastic.protocol import Member
from elastic.runner.decisions import (
    Abort,
    Evict,
    Exit,
    Fail,
    Finish,
    HostFailed,
    Job,
    Limits,
    MarkFailureReport,
    MarkShort,
    Phase,
    Publish,
    RecordExit,
    Reform,
    Removed,
    Spawn,
    StartFinishing,
    Stop,
    evolve,
)
from elastic.runner.hosts import HostManager
from elastic.runner.policy import FAILURE_REPORT_GRACE_S, JOIN_BATCH_S, JOIN_TOGETHER_S, decide


def _replace(view, **changes):
    return dataclasses.replace(view, **changes)


def member(worker_id, host, rank=0, size=1):
    """A round member where only its id and host matter (local and cross ranks as alone)."""
    return Member(worker_id, host, rank, size, 0, 1, 0, 1)


# -- start ------------------------------------------------------------------------------------

def test_start_spawns_a_worker_per_slot_with_its_tentative_membership():
    world = World({"a": 2, "b": 1}, Limits(np=3, min_np=1))
    actions = world.tick(0.0)
    assert actions == [
        Spawn("0", "a", 0, Member("0", "a", rank=0, size=3, local_rank=0,
                                   local_size=2, cross_rank=0, cross_size=2)),
        Spawn("1", "a", 1, Member("1", "a", rank=1, size=3, local_rank=1,
                                   local_size=2, cross_rank=0, cross_size=1)),
        Spawn("2", "b", 0, Member("2", "b", rank=2, size=3, local_rank=0,
                                   local_size=1, cross_rank=1, cross_size=2)),
    ]
    assert world.job.phase is Phase.STARTING and world.job.next_worker == 3


def test_start_waits_for_workers_importing_torch_then_publishes_round_1():
    world = World({"a": 2})
    world.tick(0.0)
    assert world.tick(1.0) == []                      # both still starting
    world.ready("0")
    assert world.tick(2.0) == []                      # one still starting: not a shortage
    world.ready("1")
    (publish,) = world.tick(3.0)
    assert publish.round_id == 1 and publish.change == "start"
    assert [m.worker_id for m in publish.members] == ["0", "1"]
    assert world.job.phase is Phase.RUNNING and world.job.host_order == ("a",)


def test_start_with_too_few_slots_waits_then_fails_after_the_elastic_timeout():
    world = World({"a": 1}, Limits(np=2, min_np=2, elastic_timeout=10))
    assert world.tick(0.0) == [MarkShort(0.0)]        # no worker is started below -np
    assert world.tick(5.0) == []
    assert world.tick(10.5) == [Fail("only 1 of the 2 slots needed to start became available "
                                     "within --elastic-timeout 10 s")]


def test_start_with_fewer_ready_workers_than_min_np_is_a_shortage():
    world = World({"a": 2}, Limits(np=2, min_np=2, elastic_timeout=100))
    world.tick(0.0)
    world.ready("0")
    world.workers["1"] = _replace(world.workers["1"], started=-JOIN_BATCH_S)  # still waited for
    assert world.tick(1.0) == []
    world.workers["1"] = _replace(world.workers["1"], started=-Limits().startup_timeout)
    assert world.tick(1.0) == [MarkShort(1.0)]                              # gave up waiting


def test_the_start_waits_for_every_slow_starter_up_to_the_start_timeout():
    # -np 4 starts 4, however long torch takes to import on a loaded node, until the
    # slow one would be evicted anyway; newcomers in a running job wait JOIN_BATCH_S only.
    world = World({"a": 4}, Limits(np=4, min_np=2))
    world.tick(0.0)
    world.ready("0", "1", "2")
    assert world.tick(JOIN_BATCH_S + 1) == []
    world.ready("3")
    (publish,) = world.tick(JOIN_BATCH_S + 2)
    assert isinstance(publish, Publish) and len(publish.members) == 4


def test_start_below_min_np_slots_after_spawning_is_a_shortage():
    world = World({"a": 2}, Limits(np=2, min_np=1))
    world.tick(0.0)
    world.hosts.update({}, 1.0)                       # the host went away again
    assert kinds(world.tick(1.0)) == ["Stop", "Stop", "MarkShort"]


# -- growth -----------------------------------------------------------------------------------

def test_growth_spawns_newcomers_then_batches_them_into_one_new_round():
    world = World({"a": 2}, Limits(np=2, min_np=1, max_np=8))
    world.running()
    world.hosts.update({"a": 2, "b": 2}, 2.0)
    actions = world.tick(2.0)
    assert kinds(actions) == ["Spawn", "Spawn"]
    assert [(a.host, a.assignment.rank) for a in actions] == [("b", 2), ("b", 3)]
    world.ready("2")
    assert world.tick(3.0) == []                      # worker 3 still imports torch
    world.ready("3")
    (publish,) = world.tick(4.0)
    assert publish.round_id == 2 and publish.change == "+2 on b"
    assert world.job.resets == 1


def test_a_ready_replacement_is_not_held_back_by_one_spawned_much_later():
    """Churn: a replacement ready to join does not wait (up to JOIN_BATCH_S) for the
    replacement of a later crash that is still importing torch."""
    world = World({"a": 2}, Limits(np=2, min_np=1, max_np=8))
    world.running()
    world.hosts.update({"a": 2, "b": 1}, 2.0)
    assert kinds(world.tick(2.0)) == ["Spawn"]        # worker 2 on b
    later = 2.0 + JOIN_TOGETHER_S + 1                 # well within JOIN_BATCH_S
    assert later + 1 < 2.0 + JOIN_BATCH_S
    world.hosts.update({"a": 2, "b": 1, "c": 1}, later)
    assert kinds(world.tick(later)) == ["Spawn"]      # worker 3 on c
    world.ready("2")
    (publish,) = world.tick(later + 1)
    assert isinstance(publish, Publish) and publish.change == "+1 on b"


def test_growth_beyond_max_np_is_not_spawned():
    world = World({"a": 2}, Limits(np=2, min_np=1, max_np=2))
    world.running()
    world.hosts.update({"a": 2, "b": 2}, 2.0)
    assert world.tick(2.0) == []


def test_reset_limit_fails_the_job_at_the_round_that_exceeds_it():
    world = World({"a": 2}, Limits(np=2, min_np=1, reset_limit=0))
    world.running()
    world.hosts.update({"a": 2, "b": 1}, 2.0)
    world.tick(2.0)
    world.ready()
    assert world.tick(3.0) == [Fail("reset limit 0 reached; membership changed too often")]


# -- crash ------------------------------------------------------------------------------------

def test_a_crash_blacklists_the_host_aborts_the_round_and_reforms_with_the_survivors():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1))
    world.running()
    world.exit("1", 1)
    actions = world.tick(2.0)
    assert actions[:4] == [RecordExit("1", 1, final=False),
                           HostFailed("1", "b", "worker 1 on b exited with code 1"),
                           Abort(1), Reform()]
    publish = actions[4]
    assert isinstance(publish, Publish) and publish.change == "-1 on b"
    assert [m.worker_id for m in publish.members] == ["0"]
    assert world.job.failed_exits == {"1": 1} and world.job.last_failure.startswith("worker 1")


def test_a_crash_stops_the_other_workers_on_the_same_host():
    world = World({"a": 2, "b": 1}, Limits(np=3, min_np=1))
    world.running()
    world.exit("0", -9)
    actions = world.tick(2.0)
    assert actions[:5] == [RecordExit("0", -9, final=False),
                           HostFailed("0", "a", "worker 0 on a exited with code -9"),
                           Stop("1"), Abort(1), Reform()]
    assert [m.worker_id for m in actions[5].members] == ["2"]


def test_after_a_crash_too_few_workers_is_a_shortage_that_fails_after_the_timeout():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=2, elastic_timeout=10))
    world.running()
    world.exit("1", 1)
    actions = world.tick(2.0)
    assert kinds(actions) == ["RecordExit", "HostFailed", "Abort", "Reform", "MarkShort"]
    assert world.job.phase is Phase.REFORMING
    assert world.tick(13.0) == [Fail("only 1 of the 2 slots needed to continue became available "
                                     "within --elastic-timeout 10 s")]


def test_every_host_blacklisted_for_good_fails_at_once_naming_the_last_failure():
    world = World({"a": 1}, Limits(np=1, min_np=1))
    world.tick(0.0)
    world.exit("0", 3)                                 # crashed at import
    assert world.tick(1.0) == [
        RecordExit("0", 3, final=False), HostFailed("0", "a", "worker 0 on a exited with code 3"),
        MarkShort(1.0), Fail("every host is blacklisted; no slots left to run on "
                             "(last failure: worker 0 on a exited with code 3)")]


def test_with_a_cooldown_a_blacklisted_host_is_waited_for():
    world = World({"a": 1}, Limits(np=1, min_np=1, elastic_timeout=100), cooldown=(10, 10))
    world.tick(0.0)
    world.exit("0", 3)
    assert Fail not in map(type, world.tick(1.0))      # the host returns at 11 s
    assert world.tick(5.0) == []
    assert world.tick(12.0) == [Spawn("1", "a", 0, Member(
        "1", "a", rank=0, size=1, local_rank=0, local_size=1,
        cross_rank=0, cross_size=1))]


def test_when_no_round_member_is_left_the_job_fails():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1), cooldown=(50, 50))
    world.running()
    world.exit("0", 1)
    world.exit("1", 1)
    actions = world.tick(2.0)
    assert actions[-1] == Fail("all workers failed (round 1 has no survivor holding the "
                               "training state)")


# -- liveness ---------------------------------------------------------------------------------

def test_a_silent_worker_is_evicted_and_its_host_blacklisted():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, worker_timeout=5))
    world.running()
    world.ready("0", at=9.0)
    world.ready("1", at=3.0)
    assert world.tick(7.5, liveness=True) == []
    assert world.tick(8.5, liveness=False) == []       # counters not read: no decision
    actions = world.tick(8.5, liveness=True)
    assert actions[:5] == [Stop("1"), Evict("1", "b"),
                           HostFailed("1", "b", "worker 1 on b sent no heartbeat for 5 s; evicted"),
                           Stop("1"), Abort(1)]


def test_a_ready_worker_whose_beats_never_reached_the_driver_is_still_evicted():
    # Its beats were overwritten before any was read (or it hung right after registering):
    # the ready key is its last sign of life, and --worker-timeout runs from there.
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, worker_timeout=5))
    world.running()
    world.ready("0", at=9.0)
    world.ready("1", beats=0, at=3.0)
    assert world.tick(7.5, liveness=True) == []
    actions = world.tick(8.5, liveness=True)
    assert actions[:3] == [Stop("1"), Evict("1", "b"),
                           HostFailed("1", "b", "worker 1 on b sent no heartbeat for 5 s; evicted")]


def test_a_worker_that_never_starts_is_evicted_after_the_startup_timeout():
    limits = Limits(np=1, min_np=1, worker_timeout=1)
    world = World({"a": 1}, limits)
    world.running()
    world.hosts.update({"a": 1, "b": 1}, 2.0)
    world.tick(2.0)                                    # spawns worker 1 on b
    world.ready("0", at=2.0 + limits.startup_timeout)
    assert world.tick(2.0 + limits.startup_timeout, liveness=True) == []
    actions = world.tick(2.5 + limits.startup_timeout, liveness=True)
    assert actions[:3] == [Stop("1"), Evict("1", "b"), HostFailed(
        "1", "b", "worker 1 on b did not start within 120 s; evicted")]


def test_a_reported_collective_failure_reforms_the_round_after_a_grace_period():
    world = World({"a": 1, "b": 1})
    world.running()
    world.reports, world.errors = 1, {"1": "process group for round 1 failed:\n no device"}
    assert world.tick(2.0) == [MarkFailureReport(2.0)]
    assert world.tick(2.0 + FAILURE_REPORT_GRACE_S / 2) == []
    actions = world.tick(2.0 + FAILURE_REPORT_GRACE_S)
    notice = actions[0]
    assert notice.line == ("round 1 failed: worker 1 on b (rank 1): process group for round 1 "
                           "failed: no device; re-forming it (1 of 3 with these members)")
    assert notice.event == "round_failed" and dict(notice.fields) == {
        "round": 1, "errors": {"1": "process group for round 1 failed: no device"}}
    assert kinds(actions)[1:5] == ["Track", "Reform", "Abort", "MarkFailureReport"]
    assert isinstance(actions[5], Publish) and actions[5].change == ""   # same members again


def test_a_failure_in_a_round_that_a_join_replaced_aborts_that_round():
    """A join publishes round 2 while round 1 syncs; a peer then fails in round 1. Its other
    members would wait there for the collective timeout while round 2 waits for them."""
    world = World({"a": 1}, Limits(np=1, min_np=1, max_np=2))
    world.running()
    world.hosts.update({"a": 1, "b": 1}, 2.0)
    world.tick(2.0)                                    # spawns worker 1 on b
    world.ready("1", at=3.0)
    (publish,) = world.tick(3.0 + JOIN_BATCH_S)
    assert publish.round_id == 2 and 1 not in world.job.aborted
    world.joined = 0                                   # round 2 waits for worker 0
    world.replaced_failed = (1,)
    actions = world.tick(4.0 + JOIN_BATCH_S)
    assert kinds(actions) == ["Notice", "Abort"] and actions[1] == Abort(1)
    assert actions[0].event == "replaced_round_aborted"
    assert world.tick(5.0 + JOIN_BATCH_S) == []        # aborted once
    assert world.job.round_id == 2                     # round 2 stands: nothing re-forms


# -- removal ----------------------------------------------------------------------------------

def test_a_removed_host_leaves_at_once_and_its_workers_exit_as_removed():
    world = World({"a": 1, "b": 1})
    world.running()
    world.hosts.update({"a": 1}, 2.0)
    (publish,) = world.tick(2.0)                       # no Stop: they leave at their next commit
    assert publish.change == "-1 on b" and publish.round_id == 2
    world.exit("1", 0)
    assert world.tick(3.0) == [Removed("1", "b")]


def test_a_never_admitted_worker_on_a_removed_host_is_stopped():
    world = World({"a": 1}, Limits(np=1, min_np=1))
    world.running()
    world.hosts.update({"a": 1, "b": 1}, 2.0)
    world.tick(2.0)                                    # spawns 1 on b, still starting
    world.hosts.update({"a": 1}, 3.0)
    assert world.tick(3.0) == [Stop("1")]


# -- steering: elasticctl drain and resize (issue 30) -----------------------------------------

def test_a_drained_host_leaves_at_the_next_commit_unblamed_and_gets_no_new_workers():
    world = World({"a": 1, "b": 1})
    world.running()
    world.drained = frozenset({"b"})
    (publish,) = world.tick(2.0)                       # no Stop: it leaves at its next commit
    assert publish.change == "-1 on b" and publish.round_id == 2
    world.exit("1", 0)
    assert world.tick(3.0) == [Removed("1", "b")]
    assert world.hosts.blacklisted(3.0) == ()          # drained, not blamed
    world.hosts.update({"a": 1, "b": 2}, 4.0)          # discovery still lists it: it stays out
    assert world.tick(4.0) == []


def test_a_never_admitted_worker_on_a_drained_host_is_stopped():
    world = World({"a": 1}, Limits(np=1, min_np=1))
    world.running()
    world.hosts.update({"a": 1, "b": 1}, 2.0)
    world.tick(2.0)                                    # spawns 1 on b, still starting
    world.drained = frozenset({"b"})
    assert world.tick(3.0) == [Stop("1")]


def test_a_lower_max_np_publishes_a_smaller_round_and_a_higher_one_spawns_again():
    world = World({"a": 2, "b": 2}, Limits(np=4, min_np=1))
    world.running()
    world.limits = dataclasses.replace(world.limits, max_np=2)
    (publish,) = world.tick(2.0)                       # b's workers leave at their next commit
    assert publish.round_id == 2 and [m.host for m in publish.members] == ["a", "a"]
    world.exit("2", 0)
    world.exit("3", 0)
    assert world.tick(3.0) == [Removed("2", "b"), Removed("3", "b")]
    world.limits = dataclasses.replace(world.limits, max_np=3)
    actions = world.tick(4.0)
    assert kinds(actions) == ["Spawn"] and actions[0].host == "b"
    world.ready(actions[0].worker_id)
    (publish,) = world.tick(5.0)
    assert publish.round_id == 3 and len(publish.members) == 3


def test_a_worker_a_round_left_out_is_not_planned_again_while_it_leaves():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1))
    world.running()
    world.limits = dataclasses.replace(world.limits, max_np=1)
    (publish,) = world.tick(2.0)                       # worker 1 (on b) is left out: it leaves
    assert [m.worker_id for m in publish.members] == ["0"]
    world.limits = dataclasses.replace(world.limits, max_np=2)
    assert world.tick(3.0) == []                       # not taken back while its process lives
    world.exit("1", 0)
    actions = world.tick(4.0)
    assert kinds(actions) == ["Removed", "Spawn"] and actions[1].host == "b"


# -- the final round --------------------------------------------------------------------------

def test_the_final_round_finishes_when_all_its_workers_exit_0():
    world = World({"a": 2, "b": 1}, Limits(np=2, min_np=1, max_np=2))
    world.running()
    world.hosts.update({"a": 2, "b": 1}, 1.5)
    world.exit("0", 0, done_round=1)
    actions = world.tick(2.0)
    assert actions == [StartFinishing(1), RecordExit("0", 0, final=True)]
    assert world.job.phase is Phase.FINISHING
    world.exit("1", 0, done_round=1)
    assert world.tick(3.0) == [RecordExit("1", 0, final=True), Finish(1, 2)]


def test_finishing_stops_workers_outside_the_final_round():
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1))
    world.running()
    world.hosts.update({"a": 1, "b": 1, "c": 1}, 2.0)
    world.tick(2.0)                                    # spawns 2 on c
    world.exit("0", 0, done_round=1)
    assert world.tick(3.0) == [StartFinishing(1), Stop("2"), RecordExit("0", 0, final=True)]
    world.exit("2", -9)
    assert world.tick(4.0) == []                       # stopped on purpose: nothing to say


def test_a_final_worker_that_fails_fails_the_job_at_the_end():
    world = World({"a": 1, "b": 1})
    world.running()
    world.exit("1", 2)                                 # failed before the others finished...
    world.exit("0", 0, done_round=1)                   # ...in the round that turned out final
    actions = world.tick(2.0)
    assert actions[-1] == Fail("worker 1 exited with code 2 at the end of training")
    assert StartFinishing(1) in actions


def test_a_script_without_elastic_init_finishes_as_its_processes():
    world = World({"a": 2})
    world.tick(0.0)
    world.exit("0", 0)                                 # never ready: never called elastic.init()
    actions = world.tick(1.0)
    assert actions == [StartFinishing(0, members=("1", "0")), RecordExit("0", 0, final=True)]
    world.exit("1", 0)
    assert world.tick(2.0) == [RecordExit("1", 0, final=True), Finish(0, 2)]


# -- purity and bookkeeping -------------------------------------------------------------------

def test_decide_changes_none_of_its_facts():
    world = World({"a": 1, "b": 1})
    world.running()
    world.exit("1", 1)
    facts = world.facts()
    before = (copy.deepcopy(facts.hosts.__dict__), facts.job, dict(facts.workers))
    first = decide(facts, 2.0)
    assert (facts.hosts.__dict__, facts.job, dict(facts.workers)) == before
    assert decide(facts, 2.0) == first                 # same facts, same decisions


def test_evolve_tracks_rounds_resets_and_host_order():
    job = evolve(Job(), Publish(1, (member("0", "a"), member("1", "b")), "start"))
    job = evolve(job, Publish(2, (member("1", "b"), member("2", "c")), "-1 on a, +1 on c"))
    assert job.round_id == 2 and job.resets == 1 and job.host_order == ("b", "c")
    assert job.rounds == {1: ("0", "1"), 2: ("1", "2")}
    assert evolve(job, Reform()).phase is Phase.REFORMING
    finishing = evolve(job, StartFinishing(2))
    assert evolve(finishing, Reform()).phase is Phase.FINISHING


# -- issue 10: rounds move on, preemption, graceful stop -------------------------------------

def test_a_round_replaced_before_it_assembled_is_aborted_first():
    from elastic.runner.decisions import Abort as _Abort
    world = World({"a": 1}, Limits(np=1, min_np=1, max_np=8))
    world.running()
    world.hosts.update({"a": 1, "b": 1}, 2.0)
    world.tick(2.0)
    world.ready("1")
    (publish,) = world.tick(3.0)                    # round 2: a newcomer; a still trains
    world.joined = 1                                # only the newcomer joined round 2
    world.hosts.update({"a": 1, "b": 1, "c": 1}, 4.0)
    world.tick(4.0)
    world.ready("2")
    actions = world.tick(5.0)
    assert kinds(actions) == ["Abort", "Publish"] and actions[0] == _Abort(2), actions


def test_a_worker_that_got_sigterm_is_preempted_not_blamed_and_its_host_held_out():
    from elastic.runner.decisions import Left, Preempted
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1))
    world.running()
    world.workers["1"] = _replace(world.workers["1"], leaving={"signal": 15})
    actions = world.tick(2.0, liveness=True)
    assert kinds(actions)[:2] == ["Preempted", "Reform"], actions
    assert actions[0] == Preempted("1", "b", 15, 2.0) and "b" in world.job.preempted
    publish = actions[-1]
    assert isinstance(publish, Publish) and [m.host for m in publish.members] == ["a"]
    world.exit("1", 0)
    world.exits[-1] = dataclasses.replace(world.exits[-1], leaving={"signal": 15, "commit": 7})
    actions = world.tick(3.0)
    assert Left("1", "b", 7) in actions
    assert not any(isinstance(a, (HostFailed, Spawn)) for a in actions), actions
    world.hosts.update({"a": 1}, 4.0)               # the machine went away
    world.tick(4.0)
    assert "b" not in world.job.preempted


def test_a_stop_waits_for_every_worker_then_ends_with_128_plus_the_signal():
    from elastic.runner.decisions import BeginStop, Stopped
    world = World({"a": 2}, Limits(np=2, min_np=1, stop_timeout=20))
    world.running()
    world.stop_signal = 15
    actions = world.tick(2.0)
    assert actions == [BeginStop(15, 2.0)]
    world.exit("0", 0)
    assert world.tick(3.0) == []                    # worker 1 has not reached its commit yet
    actions = world.tick(30.0)                      # past --stop-timeout: killed
    assert actions == [Stop("1"), Stopped(143, ("1",))]
    world.exit("1", -9)
    world.workers.clear()


# -- issue 14: bounded bookkeeping, no per-tick copies, quiet ticks -------------------------

def test_bookkeeping_stays_bounded_over_1000_publishes_with_aborts_and_failures():
    import random

    from elastic.runner.decisions import ROUNDS_KEPT
    rng = random.Random(14)
    world = World({h: 1 for h in "abcdef"}, Limits(np=4, min_np=1, max_np=8), cooldown=(1, 1))
    world.running()
    now, publishes, failures, aborts = 1.0, 1, 0, 0
    while publishes < 1000:
        now += 2.0                                   # every cooldown has run out
        world.hosts.returning(now)
        world.joined = rng.choice([None, None, 0])   # now and then a round never assembles
        if rng.random() < 0.5 and world.job.members:
            victim = rng.choice(world.job.members).worker_id
            if victim in world.workers:
                world.exit(victim, rng.choice([1, -9]))
                failures += 1
        actions = world.tick(now)
        world.ready()                                # newcomers reach elastic.init()
        actions += world.tick(now + 0.1)
        assert not any(isinstance(a, (Fail, Finish)) for a in actions), actions
        publishes += sum(isinstance(a, Publish) for a in actions)
        aborts += sum(isinstance(a, Abort) for a in actions)
        job = world.job
        assert len(job.rounds) <= ROUNDS_KEPT and job.round_id in job.rounds
        assert job.aborted <= set(job.rounds)
        assert all(job.admitted(w) for w in job.failed_exits)
    assert failures > 300 and aborts > 300 and world.job.round_id >= 1000


def test_a_final_round_the_bookkeeping_forgot_finishes_with_the_current_round():
    world = World({"a": 1, "b": 1})
    world.running()
    world.exit("0", 0, done_round=-5)                # a round long gone (or never known)
    actions = world.tick(2.0)
    assert actions[0] == StartFinishing(1) and world.job.final_round == 1


def test_decide_never_changes_the_callers_host_manager_even_when_it_blacklists():
    import random
    world = World({"a": 2, "b": 1, "c": 1}, Limits(np=4, min_np=1))
    world.hosts = HostManager((10, 100), rng=random.Random(5))
    world.hosts.update({"a": 2, "b": 1, "c": 1}, 0.0)
    world.running()
    world.exit("0", 1)                               # a crash: decide blacklists a
    facts = world.facts()
    until = facts.hosts.copy().blacklist("a", 2.0)   # what the caller's own draw will give
    before = (copy.deepcopy({k: v for k, v in facts.hosts.__dict__.items()
                             if not isinstance(v, random.Random)}), facts.hosts.version)
    actions = decide(facts, 2.0)
    assert HostFailed("0", "a", "worker 0 on a exited with code 1") in actions
    after = ({k: v for k, v in facts.hosts.__dict__.items() if not isinstance(v, random.Random)},
             facts.hosts.version)
    assert after == before and not facts.hosts.is_blacklisted("a", 2.0)
    assert decide(facts, 2.0) == actions
    assert facts.hosts.blacklist("a", 2.0) == until  # its rng did not move either


def _quiet(world, **changes):
    """can_skip's arguments for a tick on which nothing happened since a settled decide."""
    args = dict(settled_at=9.0, exits=(), liveness_checked=False, failure_reports=0,
                newly_ready=0, unready=0, last_spawn_at=0.0, hosts_changed=False,
                stop_signal=None)
    args.update(changes)
    return args


def test_can_skip_a_quiet_tick_of_a_running_job_and_decide_agrees():
    from elastic.runner.policy import can_skip
    world = World({"a": 1, "b": 1})
    world.running()
    assert world.tick(9.0) == []
    assert can_skip(world.job, world.limits, 10.0, **_quiet(world))
    assert decide(world.facts(), 10.0) == []


def test_can_skip_says_no_whenever_something_or_the_clock_may_matter():
    from elastic.runner.policy import can_skip
    world = World({"a": 1, "b": 1})
    world.running()
    job, limits = world.job, world.limits
    for change in [dict(settled_at=None), dict(settled_at=11.0), dict(exits=(Exit("0", "a", 1),)),
                   dict(liveness_checked=True), dict(failure_reports=1), dict(newly_ready=1),
                   dict(hosts_changed=True), dict(stop_signal=15),
                   dict(unready=1, last_spawn_at=9.0 - JOIN_BATCH_S / 2),
                   dict(unready=1, last_spawn_at=None)]:
        assert not can_skip(job, limits, 10.0, **_quiet(world, **change)), change
    # A newcomer that started long before the settled decide no longer counts as starting.
    assert can_skip(job, limits, 10.0, **_quiet(world, unready=1, last_spawn_at=9.0 - JOIN_BATCH_S))
    r = dataclasses.replace
    for other in [r(job, phase=Phase.STARTING), r(job, phase=Phase.REFORMING),
                  r(job, short_since=5.0), r(job, failure_report_at=9.5),
                  r(job, stop_signal=15, stop_at=9.0),
                  r(job, preempted={"b": 10.0 - limits.preempted_hold - 0.1})]:
        assert not can_skip(other, limits, 10.0, **_quiet(world)), other
    assert can_skip(r(job, preempted={"b": 10.0 - limits.preempted_hold}), limits, 10.0,
                    **_quiet(world))
    assert can_skip(r(job, phase=Phase.FINISHING, final_round=1), limits, 10.0, **_quiet(world))


def _random_liveness(rng, now, round_id):
    from elastic.runner.stalls import Liveness
    waiting = rng.choice([None, None, {"what": rng.choice(["allreduce", "group set-up"]),
                                       "round": rng.choice([round_id, round_id - 1]),
                                       "seconds": rng.choice([0.1, 5.0, 50.0])}])
    return Liveness(beat=1, beat_at=now, progress=(1, 1),
                    progress_at=now - rng.choice([0.0, 3.0, 60.0]), waiting=waiting)


def _simulate(seed, steps=120):
    """A random job as the driver runs it: can_skip decides whether decide runs at all.
    Returns how many ticks were skipped; asserts decide had nothing to do on each."""
    import random

    from elastic.runner.planner import Candidate, plan_round
    from elastic.runner.policy import can_skip
    rng = random.Random(seed)
    np_ = rng.randint(1, 4)
    limits = Limits(np=np_, min_np=rng.randint(1, np_), max_np=rng.choice([None, 2, 5]),
                    elastic_timeout=rng.choice([4.0, 600.0]), worker_timeout=rng.choice([2.0, 30.0]),
                    start_timeout=rng.choice([None, 20.0]), stop_timeout=5.0,
                    stall_timeout=rng.choice([4.0, 600.0]), preempted_hold=rng.choice([3.0, 60.0]))
    names = ["a", "b", "c", "d"]

    def discovered():
        return {h: rng.randint(1, 3) for h in rng.sample(names, rng.choice([1, 3, 4, 4]))}

    world = World(discovered(), limits, cooldown=rng.choice([None, (1.0, 4.0)]))
    now, settled_at, version, newly_ready, last_spawn, skipped = 0.0, None, None, 0, None, 0
    for _ in range(steps):
        now += rng.choice([0.05, 0.05, 0.05, 0.3, 1.0, 2.5, 8.0, 16.0, 40.0, 70.0])
        liveness = rng.random() < 0.3
        live = [w for w in world.workers.values() if not w.stopped]
        if live and rng.random() < 0.3:
            w = rng.choice(live)
            if not w.ready:
                world.ready(w.worker_id, at=now)
                newly_ready += 1
        if world.workers and rng.random() < 0.04:
            wid = rng.choice(list(world.workers))
            world.exit(wid, rng.choice([0, 1, 1, -9]),
                       done_round=rng.choice([None, None, world.job.round_id]))
            if rng.random() < 0.2:
                world.exits[-1] = dataclasses.replace(world.exits[-1], leaving={"signal": 15})
        if rng.random() < 0.05:
            world.hosts.update(discovered(), now)
        if rng.random() < 0.1:
            world.reports = rng.choice([0, 0, 1])
        if rng.random() < 0.1:
            world.joined = rng.choice([None, 0])
        if rng.random() < 0.01:
            world.stop_signal = 15
        if liveness:                                 # what the driver reads on these ticks only
            for wid, w in list(world.workers.items()):
                if w.ready and rng.random() < 0.8:
                    w = _replace(w, beats=w.beats + 1, heartbeat_at=now,
                                 liveness=_random_liveness(rng, now, world.job.round_id))
                if rng.random() < 0.03:
                    w = _replace(w, leaving={"signal": 15})
                world.workers[wid] = w
        world.hosts.returning(now)                   # the driver does, before deciding
        unready = sum(1 for w in world.workers.values() if not w.ready and not w.stopped)
        if can_skip(world.job, limits, now, settled_at=settled_at, exits=tuple(world.exits),
                    liveness_checked=liveness, failure_reports=world.reports,
                    newly_ready=newly_ready, unready=unready, last_spawn_at=last_spawn,
                    hosts_changed=world.hosts.version != version, stop_signal=world.stop_signal):
            assert decide(world.facts(liveness), now) == [], (seed, now)
            skipped += 1
            continue
        actions = world.tick(now, liveness)
        version, newly_ready = world.hosts.version, 0
        if any(isinstance(a, Publish) for a in actions):
            # What lets reconcile skip planning: a round, re-planned as it stands, is itself.
            job = world.job
            seats = [Candidate(m.worker_id, m.host, world.workers[m.worker_id].slot)
                     for m in job.members]
            assert plan_round(seats, list(job.host_order), limits.max_np) == list(job.members)
        if any(isinstance(a, Spawn) for a in actions):
            last_spawn = now
        settled_at = None if actions else now
        if actions and type(actions[-1]).__name__ in ("Fail", "Finish", "Stopped"):
            break
    return skipped


def test_can_skip_implies_decide_returns_nothing_on_random_jobs():
    skipped = sum(_simulate(seed) for seed in range(400))
    assert skipped > 800                             # the property was put to the test


def test_find_stalls_equals_the_straightforward_rule_on_random_views():
    import random

    from elastic.runner.stalls import (
        SETUP_WAITS,
        Liveness,
        Stall,
        StallView,
        find_stalls,
        warn_after,
    )

    def reference(views, stall_timeout, now):
        out = []
        for view in views:
            me = view.liveness
            if me.leaving:
                continue
            idle = now - me.progress_at
            peers = [v for v in views if v is not view and v.liveness.waited(now) > 0
                     and v.liveness.waiting.get("round") in view.rounds]
            if not peers:
                continue
            waited = max(p.liveness.waited(now) for p in peers)
            names = [p.liveness.waiting.get("what", "?") for p in peers]
            what = max(sorted(set(names)), key=names.count)
            peer_round = max(int(p.liveness.waiting.get("round", 0)) for p in peers)
            mine = me.waiting
            if mine is not None and not mine.get("on_peers", True):
                continue
            if mine is not None:
                older = int(mine.get("round", 0))
                if older < peer_round and older in view.rounds and \
                        mine.get("what") in SETUP_WAITS and min(idle, waited) >= stall_timeout:
                    out.append(Stall(view.worker_id, "abort", idle, len(peers), what, older))
                continue
            stalled_for = min(idle, waited)
            if stalled_for >= warn_after(stall_timeout) and not me.warned:
                out.append(Stall(view.worker_id, "warn", idle, len(peers), what))
            elif stalled_for >= stall_timeout:
                out.append(Stall(view.worker_id, "evict", idle, len(peers), what))
        return out

    rng = random.Random(10)
    now = 1000.0
    for _ in range(1500):
        views = []
        for i in range(rng.randint(0, 12)):
            waiting = rng.choice([None, {
                "what": rng.choice(["allreduce", "broadcast", "group set-up", "group check"]),
                "round": rng.randint(1, 4), "seconds": rng.choice([0.0, 1.0, 8.0, 30.0]),
                "on_peers": rng.random() < 0.9}])
            live = Liveness(beat=1, beat_at=now - rng.choice([0.0, 2.0]), progress=(1, 1),
                            progress_at=now - rng.choice([0.0, 5.0, 20.0, 90.0]),
                            waiting=waiting, warned=rng.random() < 0.3,
                            leaving=rng.random() < 0.1)
            views.append(StallView(str(i), live, set(rng.sample([1, 2, 3, 4], rng.randint(0, 3)))))
        timeout = rng.choice([4.0, 10.0, 25.0])
        assert find_stalls(views, timeout, now) == reference(views, timeout, now)
