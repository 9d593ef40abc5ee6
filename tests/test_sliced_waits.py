"""sliced.wait_sliced, the one wait loop of the worker side, driven by a fake clock; and
the waits built on it (run_blocking, waiting.wait, groups.form_groups) against a fake
round (an AbortWatch), without a store or a driver."""

import threading

import pytest

from elastic.exceptions import WorkersDepartedError
from elastic.worker import groups, waiting
from elastic.worker.devices import Placement
from elastic.worker.liveness import LeavingReport
from elastic.worker.sliced import wait_sliced


class Clock:
    """A clock that only moves when the wait sleeps."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_ready_at_once_neither_sleeps_nor_looks_at_the_abort():
    clock, looks = Clock(), []
    wait_sliced(lambda: True, lambda: looks.append(1) or False, 10, "x",
                clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [] and looks == []


def test_waits_in_slices_until_ready_looking_at_the_abort_after_each_unfinished_slice():
    clock, looks = Clock(), []
    ready = iter([False, False, False, True])
    wait_sliced(lambda: next(ready), lambda: looks.append(clock.now) or False, 10, "x",
                slice_s=0.1, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [0.1, 0.1, 0.1]
    assert len(looks) == 2        # the slice that found it ready costs no look


def test_first_slices_start_short_and_double_up_to_the_slice():
    clock = Clock()
    ready = iter([False] * 8 + [True])
    wait_sliced(lambda: next(ready), lambda: False, 10, "x", slice_s=0.001, first_s=0.0001,
                clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [0.0001, 0.0002, 0.0004, 0.0008, 0.001, 0.001, 0.001, 0.001]


def test_an_abort_abandons_the_wait_and_runs_on_abandon_first():
    clock, abandoned = Clock(), []
    aborts = iter([False, False, True])
    with pytest.raises(WorkersDepartedError, match="allreduce abandoned: round 7 was aborted"):
        wait_sliced(lambda: False, lambda: next(aborts), 10, "allreduce",
                    clock=clock, sleep=clock.sleep, on_abandon=lambda: abandoned.append(clock.now),
                    aborted_why="round 7 was aborted")
    assert len(clock.sleeps) == 3 and abandoned == [clock.now]


def test_the_deadline_ends_a_wait_that_never_finishes():
    clock, abandoned = Clock(), []
    with pytest.raises(WorkersDepartedError, match="recv timed out"):
        wait_sliced(lambda: False, lambda: False, 2.0, "recv", slice_s=0.5,
                    clock=clock, sleep=clock.sleep, on_abandon=lambda: abandoned.append(1))
    assert 2.0 < clock.now <= 2.5 and abandoned == [1]


def test_gave_up_names_the_failure_for_both_ends():
    clock = Clock()
    with pytest.raises(WorkersDepartedError, match="^group did not form$"):
        wait_sliced(lambda: False, lambda: True, 10, "group", clock=clock, sleep=clock.sleep,
                    gave_up="group did not form")
    with pytest.raises(WorkersDepartedError, match="^group did not form$"):
        wait_sliced(lambda: False, lambda: False, 1, "group", clock=clock, sleep=clock.sleep,
                    gave_up="group did not form")


def test_an_error_from_ready_propagates_as_it_is():
    def broken():
        raise WorkersDepartedError("work failed: peer gone")
    with pytest.raises(WorkersDepartedError, match="peer gone"):
        wait_sliced(broken, lambda: False, 10, "x")


class FakeRound:
    """An AbortWatch: the round's id, its timeout, and an abort the test sets."""

    def __init__(self, round_id=3, timeout=60.0):
        self.round_id = round_id
        self.collective_timeout = timeout
        self.aborted = threading.Event()
        self.looks = 0

    def round_aborted(self):
        self.looks += 1
        return self.aborted.is_set()


def test_run_blocking_returns_the_result_or_abandons_on_the_fake_rounds_abort():
    rnd = FakeRound()
    assert waiting.run_blocking(lambda: 42, "sum", rnd) == 42
    release = threading.Event()
    rnd.aborted.set()
    with pytest.raises(WorkersDepartedError, match="state send abandoned: round 3 was aborted"):
        waiting.run_blocking(lambda: release.wait(30), "state send", rnd)
    release.set()
    with pytest.raises(WorkersDepartedError, match="state receive failed: boom"):
        waiting.run_blocking(lambda: (_ for _ in ()).throw(RuntimeError("boom")),
                             "state receive", None)


class PendingWork:
    """gloo-like work that never completes (a peer that waits on a dead survivor)."""

    def is_completed(self):
        return False

    def get_future(self):
        import torch
        return torch.futures.Future()

    def wait(self):
        raise AssertionError("an abandoned wait never blocks on the work")


class Progress:
    def __init__(self):
        self.waits = []

    def begin_wait(self, what, round_id):
        self.waits.append((what, round_id))

    def end_wait(self):
        self.waits.append("end")


class FakeWaits(FakeRound):
    """What waiting.wait reads (waiting.RoundWaits): gloo work, no device group."""

    polls_work = False

    def __init__(self):
        super().__init__(round_id=5, timeout=0.5)
        self.progress = Progress()

    def abort_device_group(self):
        raise AssertionError("gloo work is not polled")


def test_wait_reports_where_it_waits_and_gives_up_at_the_fake_rounds_timeout():
    rnd = FakeWaits()
    with pytest.raises(WorkersDepartedError, match="allreduce timed out"):
        waiting.wait(PendingWork(), "allreduce", rnd)
    assert rnd.progress.waits == [("allreduce", 5), "end"] and rnd.looks >= 1


def test_form_groups_gives_up_when_the_fake_round_is_aborted():
    import torch.distributed as dist
    rnd = FakeRound(round_id=9, timeout=30.0)
    rnd.aborted.set()
    store = dist.HashStore()     # rank 1 of 2 waits for a rank 0 that never comes
    with pytest.raises(WorkersDepartedError, match="^round 9 groups did not form$"):
        groups.form_groups(rnd, store, 1, 2, Placement("gloo", None), "round 9 groups")


class Conn:
    def __init__(self):
        self.values = {}

    def put(self, key, value):
        self.values[key] = value


def test_the_leaving_report_keeps_the_commit_it_left_at():
    signal = [15]
    report, conn = LeavingReport("w1", lambda: signal[0]), Conn()
    report.put(conn)
    (key, first), = conn.values.items()
    assert first == {"signal": 15, "commit": None}
    report.put(conn, commit=12)
    report.put(conn)      # the heartbeat's later write keeps the number
    assert conn.values[key] == {"signal": 15, "commit": 12}


def test_work_without_a_future_is_let_go_once_waited_and_its_waits_reuse_one_thread():
    """gloo's reduce-scatter (FSDP2's, once per layer per step) returns work without a
    future whose is_completed() stays False: a real gloo group, 60 of them waited on."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
    tracked = groups.TrackedGroup(pg)
    threads_before = waiting.blocker_threads()
    reduce_scatter = getattr(tracked, "_reduce_scatter_base")  # noqa: B009 - torch's backend name
    for i in range(60):
        out = torch.empty(4)
        work = reduce_scatter(out, torch.full((4,), float(i)))
        waiting.wait(work, "reduce-scatter")
        assert out.tolist() == [float(i)] * 4
    assert tracked.pending() == 0 and tracked.drained()
    assert waiting.blocker_threads() - threads_before <= 1


def test_gloo_waits_of_a_small_round_look_early_and_a_big_rounds_stay_even():
    from elastic.worker.sliced import FIRST_LOOK_S, WAIT_SLICE_S, first_look_s
    assert first_look_s(4) == FIRST_LOOK_S < WAIT_SLICE_S
    assert first_look_s(64) == FIRST_LOOK_S
    assert first_look_s(65) is None and first_look_s(None) is None
    # A small round's wait that a member's report ends: looks at +0.02 and +0.06 s.
    clock, looks = Clock(), []
    reported = iter([False, True])
    with pytest.raises(WorkersDepartedError):
        wait_sliced(lambda: False, lambda: looks.append(round(clock.now, 3)) or next(reported),
                    10, "allreduce", first_s=first_look_s(4), clock=clock, sleep=clock.sleep)
    assert looks == [0.02, 0.06]
