"""Repeating faults, holders of the state and stragglers, decided without processes.

The policy's steps (repeats.py, verdicts.py, holders.py, stragglers.py) driven through
``decide`` with the ``World`` of tests/support/decide_world.py; the multi-process versions are in
test_repeat_faults.py.
"""

import dataclasses

from support.decide_world import World, kinds

from elastic.runner.decisions import Fail, HostFailed, Limits, Notice, Publish
from elastic.runner.holders import holder_grace
from elastic.runner.policy import FAILURE_REPORT_GRACE_S
from elastic.runner.repeats import GROUP_REPEAT_LIMIT, Repeats, one_line, rank_failure
from elastic.runner.stalls import Liveness, timing_window
from elastic.runner.stragglers import StragglerRule, busy_per_commit, find, rule


def live(holds=-1, durable=-1, timing=()):
    return Liveness(beat=1, holds=holds, durable=durable, timing=timing)


def with_liveness(world, **by_worker):
    for wid, liveness in by_worker.items():
        world.workers[wid] = dataclasses.replace(world.workers[wid], liveness=liveness)


def fail_round(world, now, errors):
    """The current round reports ``errors`` and the grace runs out: that tick's actions."""
    world.reports, world.errors = len(errors), dict(errors)
    world.tick(now)
    actions = world.tick(now + FAILURE_REPORT_GRACE_S)
    world.reports, world.errors = 0, {}
    world.joined = None
    return actions


# -- a round that fails with the same members ---------------------------------------------------

def test_a_group_error_on_one_host_blames_that_host_after_the_limit_and_the_rest_go_on():
    world = World({"a": 1, "b": 1})
    world.running()
    now = 2.0
    for attempt in range(1, GROUP_REPEAT_LIMIT):
        actions = fail_round(world, now, {"1": "Unable to find address for: bogus0"})
        assert actions[0].line.endswith(f"re-forming it ({attempt} of {GROUP_REPEAT_LIMIT} "
                                        "with these members)"), actions[0]
        assert not any(isinstance(a, HostFailed) for a in actions)
        assert isinstance(actions[-1], Publish) and actions[-1].change == ""
        now += 5
    actions = fail_round(world, now, {"1": "Unable to find address for: bogus0"})
    (blame,) = [a for a in actions if isinstance(a, HostFailed)]
    assert blame.host == "b" and "only the workers on b reported it" in blame.reason
    assert "bogus0" in blame.reason
    assert not any(isinstance(a, Fail) for a in actions)
    assert world.hosts.blacklisted(now + FAILURE_REPORT_GRACE_S) == ("b",)


def test_the_repeat_limit_flag_sets_how_many_failed_rounds_come_before_the_blame():
    from elastic.runner import cli
    limit = cli.config_from_args(cli.parse(["-np", "2", "--repeat-limit", "5", "true"])
                                 ).repeat_limit
    assert limit == 5 and GROUP_REPEAT_LIMIT == 3
    assert cli.config_from_args(cli.parse(["-np", "2", "true"])).repeat_limit == 3
    world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, repeat_limit=limit))
    world.running()
    now = 2.0
    for attempt in range(1, limit):
        actions = fail_round(world, now, {"1": "Unable to find address for: bogus0"})
        assert actions[0].line.endswith(f"re-forming it ({attempt} of 5 with these members)")
        assert not any(isinstance(a, (HostFailed, Fail)) for a in actions), actions
        now += 5
    actions = fail_round(world, now, {"1": "Unable to find address for: bogus0"})
    (blame,) = [a for a in actions if isinstance(a, HostFailed)]
    assert blame.host == "b" and "failed 5 times in a row" in blame.reason


def test_an_error_every_host_reports_stops_the_job_with_that_error():
    world = World({"a": 1}, Limits(np=1, min_np=1))
    world.running()
    now = 2.0
    for _ in range(GROUP_REPEAT_LIMIT - 1):
        assert not any(isinstance(a, Fail) for a in fail_round(world, now, {"0": "invalid root"}))
        now += 5
    actions = fail_round(world, now, {"0": "broadcast failed:\n invalid root rank: 5"})
    assert actions[-1] == Fail(
        f"round {GROUP_REPEAT_LIMIT} failed {GROUP_REPEAT_LIMIT} times in a row with the same "
        "members and no host to blame (every host reported it): worker 0 on a (rank 0): "
        "broadcast failed: invalid root rank: 5")


def test_a_membership_change_between_failures_starts_the_count_again():
    world = World({"a": 1, "b": 1, "c": 1}, Limits(np=3, min_np=1))
    world.running()
    fail_round(world, 2.0, {"1": "e"})
    fail_round(world, 7.0, {"1": "e"})
    world.exit("2", -9)                              # c dies: other members now
    world.tick(9.0)
    actions = fail_round(world, 12.0, {"1": "e"})
    assert not any(isinstance(a, (HostFailed, Fail)) for a in actions[:4]), actions
    assert actions[0].line.endswith(f"(1 of {GROUP_REPEAT_LIMIT} with these members)")


def test_the_round_failed_event_carries_each_reporters_error_on_one_line():
    world = World({"a": 1, "b": 1})
    world.running()
    (notice,) = [a for a in fail_round(world, 2.0, {"0": "x\n" * 400, "1": "y"})
                 if isinstance(a, Notice)]
    fields = dict(notice.fields)
    assert notice.event == "round_failed" and fields["round"] == 1
    assert fields["errors"]["1"] == "y" and "\n" not in fields["errors"]["0"]
    assert len(fields["errors"]["0"]) <= 300 and one_line("a\n b") == "a b"


# -- a rank that fails at the same commit on host after host ---------------------------------

def test_a_rank_failing_at_the_same_commit_on_two_hosts_stops_the_job():
    r, verdict = rank_failure(Repeats(), "stall", 0, "a", 12, "worker 0 on a: no progress", "x")
    assert verdict is None
    r, verdict = rank_failure(r, "stall", 0, "b", 12, "worker 1 on b: no progress", "raise it")
    assert verdict.line == ("rank 0 failed on 2 hosts in a row with no commit in between (a, b): "
                            "worker 1 on b: no progress; raise it")


def test_a_commit_between_the_failures_or_another_rank_is_no_repeat():
    r, _ = rank_failure(Repeats(), "exception", 1, "a", 12, "w", "x")
    r2, verdict = rank_failure(r, "exception", 1, "b", 13, "w", "x")     # it trained on
    assert verdict is None
    _, verdict = rank_failure(r, "exception", 0, "b", 12, "w", "x")      # another rank
    assert verdict is None
    _, verdict = rank_failure(r2, "exception", 1, "c", 13, "w", "x")
    assert verdict is not None


def test_an_exception_on_whichever_worker_runs_rank_0_stops_the_job_at_the_second_host():
    world = World({"a": 1, "b": 1, "c": 1}, Limits(np=3, min_np=1))
    world.running()
    for wid in ("0", "1", "2"):
        with_liveness(world, **{wid: live(holds=7)})
    world.tick(2.0, liveness=True)                   # the driver learns commit 7
    world.exit("0", 1)
    actions = world.tick(3.0)
    assert "HostFailed" in kinds(actions) and "Fail" not in kinds(actions)
    publish = next(a for a in actions if isinstance(a, Publish))
    assert publish.members[0].worker_id == "1"    # rank 0 now runs on b
    world.exit("1", 1)
    actions = world.tick(4.0)
    assert isinstance(actions[-1], Fail) and actions[-1].reason.startswith(
        "rank 0 failed on 2 hosts in a row with no commit in between (a, b): worker 1 on b "
        "exited with code 1; the script fails on that rank whichever host runs it")


def test_a_crash_by_a_signal_is_a_host_fault_not_a_repeat():
    world = World({"a": 1, "b": 1, "c": 1}, Limits(np=3, min_np=1))
    world.running()
    for wid in ("0", "1", "2"):
        with_liveness(world, **{wid: live(holds=7)})
    world.tick(2.0, liveness=True)
    world.exit("0", -9)
    world.tick(3.0)
    world.exit("1", -9)
    assert "Fail" not in kinds(world.tick(4.0))


# -- holders of the training state -----------------------------------------------------------

def _scale_up_then_lose_the_holder(durable=-1):
    world = World({"a": 1}, Limits(np=1, min_np=1))
    world.running()
    with_liveness(world, **{"0": live(holds=12, durable=durable)})
    world.tick(2.0, liveness=True)
    world.hosts.update({"a": 1, "b": 1}, 3.0)
    world.tick(3.0)                                  # spawns worker 1 on b
    world.ready("1", at=3.0)
    with_liveness(world, **{"1": live()})            # a newcomer holds nothing
    (publish,) = [a for a in world.tick(4.0) if isinstance(a, Publish)]
    assert publish.round_id == 2
    world.exit("0", -9)
    return world


def test_a_round_whose_members_hold_no_state_is_never_formed_and_the_job_stops():
    world = _scale_up_then_lose_the_holder()
    grace = holder_grace(world.limits)
    actions = world.tick(5.0)
    assert not any(isinstance(a, Publish) for a in actions)
    assert not any(isinstance(a, (Publish, Fail)) for a in world.tick(5.0 + grace / 2))
    actions = world.tick(5.0 + grace)
    assert actions[-1] == Fail("no surviving worker holds the training state; the last "
                               "commit was 12")


def test_a_late_heartbeat_of_a_newcomer_that_synced_lets_the_round_form():
    world = _scale_up_then_lose_the_holder()
    world.tick(5.0)
    with_liveness(world, **{"1": live(holds=12)})    # it had synced: its beat says so
    actions = world.tick(6.0, liveness=True)
    assert any(isinstance(a, Publish) for a in actions) and "Fail" not in kinds(actions)


def test_without_a_holder_a_checkpoint_lets_the_round_form_with_one_warning():
    world = _scale_up_then_lose_the_holder(durable=10)
    world.tick(5.0)
    actions = world.tick(5.0 + holder_grace(world.limits))
    (notice,) = [a for a in actions if isinstance(a, Notice)]
    assert notice.line == ("no surviving worker holds the training state (the last commit was "
                           "12); resuming from the newest checkpoint (commit 10 or newer)")
    assert notice.event == "state_lost" and any(isinstance(a, Publish) for a in actions)


# -- stragglers ------------------------------------------------------------------------------

def test_busy_time_per_commit_needs_a_full_window_and_enough_commits():
    assert busy_per_commit(((0.0, 0.0, 0), (5.0, 1.0, 10)), 10.0) is None
    assert busy_per_commit(((0.0, 0.0, 0), (10.0, 8.0, 10)), 10.0) == 0.2
    assert busy_per_commit(((0.0, 0.0, 0), (10.0, 8.0, 2)), 10.0) is None


def test_find_names_only_the_worker_ratio_times_slower_than_its_peers_median():
    assert find({"0": 0.1, "1": 0.5}, 2.0) == [("1", 5.0)]
    assert find({"0": 0.1, "1": 0.15, "2": 0.12}, 2.0) == []
    found = find({str(i): 0.1 for i in range(9)} | {"9": 0.35}, 3.0)
    assert [w for w, _ in found] == ["9"] and abs(found[0][1] - 3.5) < 1e-9
    assert find({"0": 0.0, "1": 0.0}, 2.0) == []


def test_timing_samples_stay_bounded():
    samples = ()
    for t in range(10_000):
        samples = timing_window(samples, (t * 0.5, 0.0, t))
    assert len(samples) <= 50 and samples[-1] == (4999.5, 0.0, 9999)


def test_a_straggler_gets_one_warning_and_stays_unless_the_flag_asks():
    for evict in (False, True):
        world = World({"a": 1, "b": 1}, Limits(np=2, min_np=1, stragglers=StragglerRule(
            2.0, 10.0, evict)))
        world.running()
        fast = ((0.0, 0.0, 0), (10.0, 8.0, 20))       # waits 80 % of the time
        slow = ((0.0, 0.0, 0), (10.0, 0.2, 20))       # never waits: the others wait on it
        with_liveness(world, **{"0": live(timing=fast), "1": live(timing=slow)})
        actions = world.tick(11.0, liveness=True)
        (notice,) = [a for a in actions if isinstance(a, Notice)]
        assert notice.event == "straggler" and dict(notice.fields)["worker"] == "1"
        assert notice.line.startswith("worker 1 on b is a straggler: 4.9x slower than its "
                                      "peers' median over the last 10 s")
        assert ("HostFailed" in kinds(actions)) is evict
        if not evict:
            assert not any(isinstance(a, Notice) for a in world.tick(12.0, liveness=True))


def test_straggler_flags_are_checked():
    assert rule() == StragglerRule()
    for bad in ((1.0, 30.0), (2.0, 1.0), (2.0, 600.0), (float("nan"), 30.0)):
        try:
            rule(*bad)
        except ValueError as exc:
            assert str(exc).startswith("--straggler-")
        else:
            raise AssertionError(bad)
