"""Stalls become evictions, and rounds always move on (issue 10).

The pure rule (elastic/runner/stalls.py) is tested with a fake clock; the jobs
use a real stuck training thread (threading.Event().wait()) whose heartbeat
thread lives on, and real elasticrun or a store that plays its part.
"""

import json
import os
import re
import secrets
import socket
import subprocess
import sys

import pytest
from support import procs
from support.harness import REPO, free_port, publish_round
from support.jobs import WORKLOAD, Job, assert_exactly_once, assert_memberships
from support.procs import pid_of
from support.waits import wait_until

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys
from elastic.runner.stalls import Liveness, StallView, describe, find_stalls, warn_after

HOST3 = socket.gethostname() if socket.gethostname() not in ("localhost", "127.0.0.1") \
    else socket.getfqdn()


# -- the rule ------------------------------------------------------------------------------
def _live(now, progress_at, waiting=None):
    return Liveness(beat=1, beat_at=now, progress=(1, 1), progress_at=progress_at,
                    waiting=waiting)


def _wait(what, round_id, seconds, on_peers=True):
    return {"what": what, "round": round_id, "seconds": seconds, "on_peers": on_peers}


def test_a_busy_rank_that_peers_wait_on_is_warned_about_then_evicted():
    now = 1000.0
    stuck = StallView("3", _live(now, now - 6), {5})
    peers = [StallView(str(i), _live(now, now, _wait("allreduce", 5, 6)), {5}) for i in range(3)]
    found = find_stalls([stuck] + peers, stall_timeout=10, now=now)
    assert [(s.worker_id, s.action) for s in found] == [("3", "warn")]
    assert describe(found[0], "node-b") == \
        "worker 3 on node-b: no progress for 6 s while 3 peers wait in allreduce"
    stuck.liveness.warned = True
    assert find_stalls([stuck] + peers, stall_timeout=10, now=now) == []   # warned once
    later = now + 5
    found = find_stalls([stuck] + peers, stall_timeout=10, now=later)
    assert [(s.worker_id, s.action) for s in found] == [("3", "evict")]
    # A tick that comes late still warns first, and evicts at the next one.
    stuck.liveness.warned = False
    found = find_stalls([stuck] + peers, stall_timeout=10, now=later)
    assert [(s.worker_id, s.action) for s in found] == [("3", "warn")]


def test_busy_alone_is_not_a_stall_nor_is_a_wait_on_the_driver_or_another_round():
    now = 1000.0
    # Rank 0 evaluates for an hour while nobody waits on it.
    alone = StallView("0", _live(now, now - 3600), {1})
    idle_peer = StallView("1", _live(now, now - 3600, _wait("next round", 1, 3600, False)), {1})
    assert find_stalls([alone, idle_peer], stall_timeout=10, now=now) == []
    # Peers wait in a round the busy rank is not a member of.
    other = StallView("2", _live(now, now, _wait("allreduce", 7, 3600)), {7})
    assert find_stalls([alone, other], stall_timeout=10, now=now) == []
    # Everyone waits in the same collective: nobody is the stuck one.
    waiters = [StallView(str(i), _live(now, now - 3600, _wait("allreduce", 1, 3600)), {1})
               for i in range(3)]
    assert find_stalls(waiters, stall_timeout=10, now=now) == []


def test_a_member_left_waiting_in_a_replaced_round_gets_that_round_aborted_not_blamed():
    now = 1000.0
    behind = StallView("1", _live(now, now - 30, _wait("group set-up", 4, 30)), {4, 5})
    ahead = StallView("2", _live(now, now, _wait("round 5 assembly", 5, 30)), {5})
    found = find_stalls([behind, ahead], stall_timeout=10, now=now)
    assert [(s.worker_id, s.action, s.round_id) for s in found] == [("1", "abort", 4)]
    # Waiting in a collective of the older round: it waits on a peer, nothing to abort.
    behind.liveness.waiting = _wait("allreduce", 4, 30)
    assert find_stalls([behind, ahead], stall_timeout=10, now=now) == []
    # Once round 4 is aborted (no longer one of its live rounds) it is not aborted again.
    behind.liveness.waiting = _wait("group set-up", 4, 30)
    behind.rounds = {5}
    assert find_stalls([behind, ahead], stall_timeout=10, now=now) == []


def test_progress_resets_the_clock_and_the_warning():
    live = Liveness(progress_at=0.0)
    assert live.update({"beat": 1, "waits": 3, "commits": 1, "waiting": None}, 5.0)
    assert live.progress_at == 5.0
    live.warned = True
    assert live.update({"beat": 2, "waits": 3, "commits": 1, "waiting": None}, 9.0)
    assert live.progress_at == 5.0 and live.warned     # same progress: the clock runs on
    assert not live.update({"beat": 2, "waits": 4}, 10.0)   # not a new beat: ignored
    assert live.update({"beat": 3, "waits": 4, "commits": 1, "waiting": None}, 11.0)
    assert live.progress_at == 11.0 and not live.warned
    assert warn_after(600) == 60 and warn_after(10) == 5


# -- real jobs -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_stuck_training_thread_is_evicted_after_the_stall_timeout_and_the_rest_go_on(tmp_path):
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "--stall-timeout", "6",
                         "-H", f"localhost:1,127.0.0.1:1,{HOST3}:1"],
              env={"JOB_FAULT": "4:1:stuck"}).start()
    job.assert_ok(job.finish(), final_size=2)
    out = job.output()
    stuck = (job.out / "fault.0").read_text()
    warning = re.search(rf"worker {stuck} on 127.0.0.1: no progress for (\d+) s while 2 peers "
                        r"wait in allreduce\n", out)
    eviction = re.search(rf"worker {stuck} on 127.0.0.1: no progress for (\d+) s while 2 peers "
                         r"wait in allreduce \(--stall-timeout 6 s\); evicted", out)
    assert warning and eviction and warning.start() < eviction.start(), out[-3000:]
    assert int(warning.group(1)) >= 3 and int(eviction.group(1)) >= 6
    assert "blacklisting host 127.0.0.1" in out
    assert "blacklisting host localhost" not in out and f"blacklisting host {HOST3}" not in out
    assert "sent no heartbeat" not in out          # its heartbeat thread lived on


@pytest.mark.slow
def test_a_member_that_never_joins_a_round_is_evicted_and_busy_alone_is_not_a_stall(tmp_path):
    """A lone worker gets stuck: nobody waits on it, so it stays. A newcomer then
    waits for it in the new round's assembly: it is evicted. The newcomer holds no
    training state and there is no checkpoint: the job stops (holders.py), it does not
    train from step 0."""
    job = Job(tmp_path, ["-np", "1", "--stall-timeout", "4"], hosts=["localhost:1"],
              env={"JOB_FAULT": "4:0:stuck", "JOB_SECRET_OUT": "1"}).start()
    job.wait_for((job.out / "fault.0").exists, "rank 0 to get stuck")
    stuck = (job.out / "fault.0").read_text()
    # Its heartbeat (read with the job's secret, as the driver does) goes on while its
    # progress stands still: let 9 more beats (over twice the stall timeout) pass.
    env = procs.environ(pid_of(job.out, stuck))
    cs = ControlStore(control.connect("127.0.0.1", env[control.ENV_PORT], 30),
                      (job.out / f"secret.{stuck}").read_bytes())
    at_fault = cs.get(Keys.heartbeat(stuck))["beat"]
    wait_until(lambda: cs.get(Keys.heartbeat(stuck))["beat"] >= at_fault + 2,
               "a heartbeat sent after it got stuck", 60)
    first = cs.get(Keys.heartbeat(stuck))
    wait_until(lambda: cs.get(Keys.heartbeat(stuck))["beat"] >= first["beat"] + 9,
               "nine more heartbeats", 120)
    last = cs.get(Keys.heartbeat(stuck))
    assert (last["waits"], last["commits"]) == (first["waits"], first["commits"])
    assert last["waiting"] is None                      # busy, not waiting
    assert "evicted" not in job.output() and "no progress" not in job.output(), job.output()
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    code = job.finish()
    out = job.output()
    assert re.search(rf"worker {stuck} on localhost: no progress for \d+ s while 1 peer waits "
                     r"in round 2 assembly \(--stall-timeout 4 s\); evicted", out), out[-3000:]
    assert code == 1, out[-3000:]
    assert re.search(r"elasticrun: error: no surviving worker holds the training state; the "
                     r"last commit was \d+\n$", out), out[-3000:]
    assert "blacklisting host 127.0.0.1" not in out


# -- rounds always move on -------------------------------------------------------------------
def _spawn(worker_id, env, tmp_path):
    out = open(tmp_path / f"{worker_id}.err", "wb")
    return subprocess.Popen([sys.executable, str(WORKLOAD)],
                            env={**env, control.ENV_WORKER_ID: worker_id},
                            stdout=subprocess.DEVNULL, stderr=out, cwd=REPO)


@pytest.mark.slow
def test_a_newcomer_waiting_for_round_n_follows_round_n_plus_1(tmp_path):
    """Plays the driver: A and B train in round 1 and are held before a commit.
    Newcomer C waits in round 2 (A, B, C); round 3 (A, C) replaces it before A and
    B commit. C must join round 3 rather than wait for round 2 to assemble."""
    port, secret = free_port(), secrets.token_hex(16)
    store = control.connect("127.0.0.1", port, 60, is_master=True)
    cs = ControlStore(store, secret)
    publish_round(cs, 1, ["A", "B"])
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", JOB_OUT=str(out), JOB_GATE="3",
               GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               ELASTIC_COLLECTIVE_TIMEOUT="120", ELASTIC_ROUND_TIMEOUT="120",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.update({control.ENV_ADDR: "127.0.0.1", control.ENV_PORT: str(port),
                control.ENV_SECRET: secret})
    workers = {wid: _spawn(wid, env, tmp_path) for wid in ("A", "B", "C")}

    def records(wid):
        path = out / f"steps.{wid}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    try:
        wait_until(lambda: all(any(r["step"] == 3 for r in records(w)) for w in "AB"),
                   "A and B at the gate", 240)
        wait_until(lambda: cs.has(Keys.ready("C")), "C to register", 240)
        publish_round(cs, 2, ["A", "B", "C"])
        wait_until(lambda: cs.get(Keys.joined(2, "C")) is not None, "C to wait in round 2", 60)
        publish_round(cs, 3, ["A", "C"])
        (out / "gate").write_text("go")
        for wid in ("A", "B", "C"):
            workers[wid].wait(240)
        errs = {w: (tmp_path / f"{w}.err").read_text() for w in "ABC"}
        assert all(p.returncode == 0 for p in workers.values()), errs
        assert "not a member of round 3" in errs["B"], errs["B"]
        assert {r["round"] for r in records("C")} == {3}, records("C")
        assert_exactly_once(json.loads((out / "history.json").read_text()), 3, 48)
        assert_memberships(records("A") + records("B") + records("C"))
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_beats_and_reads_slow_down_in_a_big_job_but_stay_within_a_tenth_of_the_timeout():
    from elastic.runner.stalls import heartbeat_interval, heartbeat_read_interval
    # Small jobs: every second, read every half second (what every other test runs).
    assert heartbeat_interval(4, 30) == 1.0 and heartbeat_read_interval(4, 30) == 0.5
    assert heartbeat_interval(4, 30, base=0.2) == 0.2
    # 4,096 workers: the store serves about 2,048 beats a second, not 4,096, and the
    # driver verifies about 1,024 seals a second.
    assert heartbeat_interval(4096, 120) == 2.0 and heartbeat_read_interval(4096, 120) == 4.0
    assert 4096 / heartbeat_interval(4096, 120) <= 2048
    assert 4096 / heartbeat_read_interval(4096, 120) <= 1024
    # A short --worker-timeout wins over the job's size: a hang is still called in time.
    assert heartbeat_interval(4096, 30) == 2.0 and heartbeat_read_interval(4096, 30) == 3.0
    assert heartbeat_interval(4096, 6) == 0.6 and heartbeat_read_interval(4096, 6) == 0.6
    assert heartbeat_interval(4, 1.5) == 0.15        # ten beats in the shortest timeout too
    # ... and read as often: a half-second read would add a third of it to every hang.
    assert heartbeat_read_interval(4, 1.5) == 0.15 and heartbeat_read_interval(4, 4) == 0.4
    assert heartbeat_interval(100_000, 120) == 12.0


def test_exits_are_polled_every_tick_in_a_small_job_and_less_often_in_a_big_one():
    from elastic.runner.stalls import exit_poll_interval
    assert exit_poll_interval(4, 0.05) == 0.05 and exit_poll_interval(1024, 0.05) == 0.05
    assert exit_poll_interval(4096, 0.05) == 0.2
    assert 4096 / exit_poll_interval(4096, 0.05) <= 20480
