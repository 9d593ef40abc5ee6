"""A running job against an outsider that has the store port but not the secret.

One job absorbs every attack (tests/support/adversary.py): a vandal overwrites every key
of the job once, at first sight, for the whole run; on top of that the outsider
forges and replays aborts, rounds, plans, counters, registrations, heartbeats
and rendezvous addresses at chosen moments: a held round, a scale-up it
prepares for, and a hung worker it tries to keep alive. The job must end as if
nothing happened: exit 0, bitwise-equal ranks, every step and sample once, and
exactly the rounds the real events call for.
"""

import os
import re
import signal
import threading

import pytest
from support.adversary import FAKE_MAC, FirstSightVandal, Outsider
from support.jobs import Job, sizes_in_order
from support.listening import listening_sockets
from support.procs import job_workers
from support.procs import state as proc_state

from elastic import protocol as control

LISTENING = re.compile(r"control store listening on (\S+):(\d+) \((.*)\)")


class HeartbeatRecorder(threading.Thread):
    """Keeps every distinct sealed heartbeat it sees, to replay them later."""

    def __init__(self, outsider, ns):
        super().__init__(name="recorder", daemon=True)
        self.o, self.ns, self.seen = outsider, ns, {}
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            for key in self.o.keys():
                if key.startswith(self.ns + "worker/") and key.endswith("/heartbeat"):
                    blob = self.o.get(key)
                    if blob and blob[64:65] == b"." and blob not in self.seen.setdefault(key, []):
                        self.seen[key].append(blob)
            self._halt.wait(0.2)

    def stop(self):
        self._halt.set()
        self.join(30)
        self.o.close()


def wait_valid(o, key, job, what):
    """Until ``key`` holds a sealed value again (the vandal hit it; its writer healed it)."""
    job.wait_for(lambda: (o.get(key) or b"")[64:65] == b".", what, timeout=60)
    return o.get(key)


@pytest.mark.slow
def test_an_outsider_cannot_end_stall_steer_or_join_the_job(tmp_path):
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--worker-timeout", "6"],
              hosts=["localhost:2"],
              env={"JOB_HOLD": "3,6", "ELASTIC_COLLECTIVE_TIMEOUT": "120"}).start()
    threads, stopped, o = [], None, None
    try:
        # -- where the store listens: loopback only, and the log says so -------------------
        job.wait_for(lambda: LISTENING.search(job.output()), "the store's address in the log")
        addr, port, reason = LISTENING.search(job.output()).groups()
        assert (addr, reason) == ("127.0.0.1", "every host is local")
        assert listening_sockets(int(port)) == {("127.0.0.1", int(port))}

        o = Outsider(addr, port)
        ns = o.namespace()
        vandal = FirstSightVandal(Outsider(addr, port), ns)
        recorder = HeartbeatRecorder(Outsider(addr, port), ns)
        threads += [vandal, recorder]
        for t in threads:
            t.start()

        # -- round 1 is held at step 3: attack it, and prepare for the next round ------------
        job.wait_step(3)
        latest1 = wait_valid(o, ns + "round/latest", job, "round/latest healed")
        plan1 = wait_valid(o, ns + "round/1/plan", job, "round 1's plan healed")
        members1 = control.decode_ids(o.payload(ns + "round/1/plan")["ids"])
        # A real worker's sealed value to replay under other keys: its heartbeat, which it
        # seals again at every beat. (Its ready key is healed only while it waits for a
        # round: the vandal may first see it after the worker joined round 1.)
        sealed0 = wait_valid(o, ns + f"worker/{members1[0]}/heartbeat", job, "a heartbeat healed")
        o.forgeries(ns + "round/1/abort", replay_from=latest1)
        o.set(ns + "round/latest", b"garbage", "garbage")
        o.set(ns + "round/1/plan", b"garbage", "garbage")
        for key in ("round/1/joined", "round/1/failures", f"round/1/failed/{members1[0]}"):
            o.bump(ns + key, "counter bump")
        o.set(ns + "round/1/failures", b"7", "doorbell set to a number")
        o.bump(ns + "round/1/failures", "counter bump")
        # A fake worker registers (with a real worker's sealed value, and with garbage), as
        # does the next real worker before it started (its id is easy to guess).
        o.set(ns + "worker/666/ready", sealed0, "replayed value of another key")
        o.set(ns + "worker/666/heartbeat", b"1", "garbage")
        o.set(ns + "worker/2/ready", sealed0, "replayed value of another key")
        # Round 2 is prepared for: a forged abort, joins, plan, and fake peer addresses.
        o.forgeries(ns + "round/2/abort", replay_from=plan1)
        o.set(ns + "round/2/plan", plan1, "replayed value of another key")
        o.set(ns + "round/2/assembled", plan1, "replayed value of another key")
        for r in range(4):
            o.bump(ns + f"round/2/joined/{r}", "counter bump")
            o.set(ns + f"round/2/member/{r}", plan1, "replayed value of another key")
            real = o.get(ns + f"pg/1/gloo//0/{r % 2}") or b"garbage"
            o.set(ns + f"pg/2/gloo//0/{r}", real if r >= 2 else FAKE_MAC + b".1.10.0.0.1:1",
                  "fake peer address")
        # The driver puts its own values back: round/latest is the real one again.
        job.wait_for(lambda: o.get(ns + "round/latest") == latest1, "round/latest put back")

        # -- scale-up to 4: the round forms through everything planted for it ----------------
        job.set_hosts(["localhost:2", "127.0.0.1:2"])
        job.wait_step(6, size=4)
        wait_valid(o, ns + "round/2/plan", job, "round 2's plan healed")
        plan2 = o.payload(ns + "round/2/plan")
        # Replays of older sealed values, and the current round's abort, forged three ways.
        o.set(ns + "round/latest", latest1, "replayed older round/latest")
        o.set(ns + "round/2/plan", plan1, "replayed older plan")
        o.forgeries(ns + "round/2/abort", replay_from=latest1)

        # -- a worker hangs; the outsider beats for it; it must still be evicted -------------
        workers = job_workers(job.out)
        pid, env = next((p, e) for p, e in workers.items()
                        if e.get("ELASTIC_HOSTNAME") == "127.0.0.1")
        victim = env["ELASTIC_WORKER_ID"]
        os.kill(pid, signal.SIGSTOP)
        stopped = pid
        beat_key = ns + f"worker/{victim}/heartbeat"
        forger_stop = threading.Event()

        def forge_beats():
            while not forger_stop.is_set():
                for blob in list(recorder.seen.get(beat_key, [])):
                    o.set(beat_key, blob, "replayed heartbeat")
                o.set(beat_key, b"7", "garbage")
                o.bump(beat_key, "counter bump")
                forger_stop.wait(0.2)

        forger = threading.Thread(target=forge_beats, daemon=True)
        forger.start()
        job.release(6)
        job.wait_for(lambda: f"worker {victim} on 127.0.0.1 sent no heartbeat" in job.output(),
                     "the hung worker's eviction despite the forged beats")
        forger_stop.set()
        forger.join(10)
        code = job.finish()     # the vandal stays at work until the job has ended
    finally:
        for t in threads:
            t.stop()
        if o is not None:
            o.close()
        if stopped is not None and proc_state(stopped) is not None:
            os.kill(stopped, signal.SIGKILL)
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)

    # -- the job ended as if nobody had attacked it --------------------------------------------
    finals = job.assert_ok(code, final_size=2)
    records = job.steps()
    sizes = sizes_in_order(records)
    assert sizes[0] == 2 and 4 in sizes and sizes[-1] == 2, sizes
    # No round the real events did not call for: each one changed the membership. (A slow
    # newcomer may come in a round of its own: 2 -> 3 -> 4 -> 2 on a loaded machine.)
    rounds = sorted({r["round"] for r in records})
    members = [frozenset(r["worker"] for r in records if r["round"] == n) for n in rounds]
    assert all(a != b for a, b in zip(members, members[1:])), list(zip(rounds, members))
    assert len(rounds) <= 4, rounds
    assert victim not in {f["worker"] for f in finals}
    assert {r["worker"] for r in records} <= {"0", "1", "2", "3"}   # nobody else trained
    assert control.decode_ids(plan2["ids"]) == ["0", "1", "2", "3"]
    out = job.output()
    assert "Traceback" not in out, out[-4000:]
    # Forgeries were read, and ignored with a warning that names the key.
    for key in ("round/2/abort'", "round/latest'", "round/1/failures'", "pg/"):
        assert re.search(r"ignored control-store key '[^']*" + re.escape(key), out), key
    assert len(vandal.hit) > 20 and len(o.writes) > 30, (len(vandal.hit), len(o.writes))
