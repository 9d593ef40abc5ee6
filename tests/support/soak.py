"""Soak: one elastic job through hundreds of membership changes of every kind.

    python tests/support/soak.py --changes 200 --seed 1      # make soak
    python tests/support/soak.py --changes 12 --seed 3       # the short version in make test

A seeded random schedule of faults against a real elasticrun job of
tests/workloads/train_job.py on loopback hosts (127.0.0.2 and up, each one
slot; localhost is never touched, so its worker lives through every change and
its fds, threads and RSS can be watched): SIGKILL, SIGSTOP, SIGTERM to a worker
(with its host leaving discovery, as a spot reclaim does), a stuck training
thread, hosts added and removed, a host whose gloo cannot open its data connections
(GLOO_SOCKET_IFNAME=bogus0 there: repeating group errors, blamed after
repeats.GROUP_REPEAT_LIMIT rounds and back after each cooldown), and SIGTERM to
elasticrun followed by a rerun of the same command. Before about one change in four,
every connection to the control store is reset (``ss -K``, as an idle-flow drop by a
NAT or load balancer does): the change that follows must work over the healed
connections. At the end: every rank bitwise equal, every sample trained exactly once
per epoch in the committed history, no committed step lost, and the long-lived
worker's resources bounded.

Then faults that end or roll back a job by design, each in jobs of its own: where the
network lab is available (tests/support/netlab.py), the driver's link is cut and restored a
few times (lab_cuts); every holder of the training state is lost during a scale-up
(holder_losses: the job resumes from the newest checkpoint, or stops with one line
naming the last commit); and a rank-0-only phase outlasts --stall-timeout
(rank0_phases: the job stops with one line naming the flag, and a rerun with the flag
raised resumes from the newest checkpoint). And in joining mode (elasticrun --serve and
three agents), the serving driver is SIGKILLed and started again by the same command
several times, in steady training and within an adoption (driver_restarts: the same
workers all along, every rank bitwise equal, every sample once, no step gone back).
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: support.*

from support.jobs import Job, assert_exactly_once, kill_leftover_jobs, wait_unlocked  # noqa: E402
from support.procs import alive as proc_alive  # noqa: E402
from support.procs import job_workers, resource_growth, resources  # noqa: E402
from support.procs import state as proc_state  # noqa: E402

POOL = [f"127.0.0.{i}" for i in range(2, 8)]
KEEP = "localhost"
SAMPLES = 96
BADNET = "127.0.0.9"        # its workers' gloo has no interface: every group fails there
ACTIONS = ("add", "remove", "kill", "stop", "term", "stuck", "badnet")
LIMITS = {"fds": 20, "threads": 10, "rss": 1.10}
GROUP_BACKSTOP_S = 30       # the soak job's ELASTIC_COLLECTIVE_TIMEOUT


class Soak:
    def __init__(self, workdir, changes, seed, driver_stops=1, still_s=0.0):
        self.dir = Path(workdir)
        self.still_s = still_s      # settle(): fds and threads must hold still this long
        self.rng = random.Random(seed)
        self.target = changes
        self.driver_stops = driver_stops
        self.listed = [KEEP] + POOL[:2]
        self.counts = {a: 0 for a in ACTIONS + ("driver SIGTERM + rerun", "connection reset")}
        self.runs = 0
        self.stopped_at = []        # (commit stopped at, commit resumed from)
        self.resources = []         # readings of the long-lived worker
        self.out = None
        self.ckpt = self.dir / "ckpt"
        self.events = self.dir / "events.jsonl"

    # -- the job ---------------------------------------------------------------------------
    def start(self):
        self.runs += 1
        self.out = self.dir / f"out.{self.runs}"      # worker ids start again in a rerun
        self.measured = False
        self.run_started_at = self.changes()
        # Generous for a loaded 2-core machine, where a healthy process may not run for seconds.
        args = ["-np", "1", "--min-np", "1", "--worker-timeout", "15", "--stall-timeout", "20",
                "--stop-timeout", "20", "--blacklist-cooldown-range", "1", "2",
                "--checkpoint-dir", str(self.ckpt), "--event-log", str(self.events)]
        job = Job(self.dir, args, hosts=self.listed,
                  env={"JOB_EPOCHS": "100000", "JOB_SAMPLES": str(SAMPLES),
                       "JOB_END_FILE": str(self.out / "end"), "ELASTIC_CHECKPOINT_LOCK_WAIT": "30",
                       "JOB_BAD_IFACE_HOST": BADNET,
                       # A round that BADNET's worker never joins leaves its peers' group
                       # builders blocked until this backstop; keep it short so settle() sees
                       # them end.
                       "ELASTIC_COLLECTIVE_TIMEOUT": str(GROUP_BACKSTOP_S)})
        job.out = self.out
        self.out.mkdir(exist_ok=True)
        job.env["JOB_OUT"] = str(self.out)
        job.log_path = self.dir / f"elasticrun.{self.runs}.log"
        self.job = job.start()
        return job

    def changes(self):
        """Rounds published in every run so far, less the very first (a rerun's first
        round is a change: the job came back)."""
        if not self.events.exists():
            return 0
        text = self.events.read_text()
        return max(text.count('"event": "round_started"') - 1, 0)

    def members(self):
        """{worker id: (pid, host)} of live workers that trained in the newest round."""
        records = self.job.steps()
        if not records:
            return {}
        last = max(r["round"] for r in records if "round" in r)
        in_last = {r["worker"] for r in records if r["round"] == last}
        return {env["ELASTIC_WORKER_ID"]: (pid, env.get("ELASTIC_HOSTNAME"))
                for pid, env in job_workers(self.out).items()
                if env["ELASTIC_WORKER_ID"] in in_last}

    def steady(self, timeout=120):
        """Wait for the current round to train a step (or give up after ``timeout``)."""
        start = self.changes()
        deadline = time.monotonic() + timeout
        seen = len(self.job.steps())
        while time.monotonic() < deadline:
            if self.job.proc.poll() is not None:
                raise AssertionError(f"job ended early:\n{self.job.output()[-4000:]}")
            if len(self.job.steps()) > seen + 1 and self.changes() >= start:
                return
            time.sleep(0.1)

    def keeper_pid(self):
        return next((pid for pid, env in job_workers(self.out).items()
                     if env.get("ELASTIC_HOSTNAME") == KEEP), None)

    def measure(self):
        pid = self.keeper_pid()
        if pid is not None:
            try:
                self.resources.append((self.runs, self.changes(), resources(pid)))
                self.measured = True
            except OSError:
                pass

    def settle(self, timeout=GROUP_BACKSTOP_S * 4):
        """Before the last reading: BADNET leaves, and the group builders that its failed
        rounds left blocked in gloo's connect end at the backstop. Waits for the keeper to
        come back within LIMITS (a real leak never does, and the check then fails), then for
        its fds and threads to hold still ``still_s`` (make soak: a backstop), so that the
        reading is what stays, not a builder about to end."""
        if BADNET in self.listed:
            self.set_hosts([h for h in self.listed if h != BADNET])
        first = next((r for r in self.resources if r[0] == self.runs), None)
        pid = self.keeper_pid()
        deadline = time.monotonic() + timeout
        still, still_since = None, 0.0
        while first is not None and pid is not None and time.monotonic() < deadline:
            try:
                growth = resource_growth(first[2], resources(pid))
            except OSError:
                return
            if all(growth[k] <= LIMITS[k] for k in LIMITS):
                counts = (growth["fds"], growth["threads"])
                if counts != still:
                    still, still_since = counts, time.monotonic()
                elif time.monotonic() - still_since >= self.still_s:
                    return
            time.sleep(1)

    # -- faults -----------------------------------------------------------------------------
    def set_hosts(self, hosts):
        self.listed = hosts
        self.job.set_hosts(hosts)

    def act(self, action):
        if action == "badnet":               # listed: repeating group errors until blamed
            self.set_hosts([h for h in self.listed if h != BADNET] if BADNET in self.listed
                           else self.listed + [BADNET])
            self.counts["badnet"] += 1
            return True
        members = {wid: v for wid, v in self.members().items() if v[1] != KEEP and v[1] != BADNET}
        unlisted = [h for h in POOL if h not in self.listed]
        if action == "add" and not unlisted:
            action = "remove"
        if action == "add" or not members:
            if not unlisted:
                return False
            self.set_hosts(self.listed + [self.rng.choice(unlisted)])
            self.counts["add"] += 1
            return True
        wid = self.rng.choice(sorted(members))
        pid, host = members[wid]
        if action == "remove":
            self.set_hosts([h for h in self.listed if h != host])
        elif action == "kill":
            os.kill(pid, signal.SIGKILL)
        elif action == "stop":
            os.kill(pid, signal.SIGSTOP)
        elif action == "term":
            os.kill(pid, signal.SIGTERM)             # the spot interruption notice ...
            self.set_hosts([h for h in self.listed if h != host])   # ... and the reclaim
        elif action == "stuck":
            (self.out / f"stuck.{wid}").write_text("stuck")
        self.counts[action] += 1
        return True

    def reset_connections(self):
        """Reset every connection to the store (workers' and the driver's helpers'),
        most of them idle; skipped where ss cannot destroy sockets."""
        live = job_workers(self.out)
        if not live or shutil.which("ss") is None:
            return
        port = next(iter(live.values()))["ELASTIC_STORE_PORT"]
        done = subprocess.run(["ss", "-K", "-tnH", f"dport = :{port}"], capture_output=True)
        if done.returncode == 0 and done.stdout.strip():
            self.counts["connection reset"] += 1

    def quiet(self, timeout=120):
        """No stopped or stuck worker left: every worker can reach the stop's commit."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = job_workers(self.out)
            stuck = {p.name.split(".", 1)[1] for p in self.out.glob("stuck.*")}
            if not any(proc_state(pid) == "T" or env["ELASTIC_WORKER_ID"] in stuck
                       for pid, env in live.items()):
                return
            time.sleep(0.1)

    def driver_stop_and_rerun(self):
        self.quiet()
        self.steady()
        job = self.job
        os.kill(job.proc.pid, signal.SIGTERM)
        code = job.finish(timeout=240)
        assert code == 143, job.output()[-4000:]
        stops = re.findall(r"stopped at commit (\d+)", job.output())
        self.counts["driver SIGTERM + rerun"] += 1
        self.start()
        self.job.wait_for(lambda: "resumed from checkpoint" in self.job.output(), "the resume")
        resumed = re.findall(r"resumed from checkpoint \S+ \(commit (\d+)\)", self.job.output())
        self.stopped_at.append((int(stops[0]) if stops else None, int(resumed[0])))

    # -- the run ----------------------------------------------------------------------------
    def run(self):
        started = time.monotonic()
        self.start()
        self.job.wait_step(2)
        stop_points = sorted(self.rng.sample(range(self.target // 4, self.target * 3 // 4 + 1),
                                             self.driver_stops)) if self.driver_stops else []
        weights = (4, 3, 3, 1, 3, 1, 1)
        while self.changes() < self.target:
            self.steady(timeout=30)
            if not self.measured and self.changes() > self.run_started_at:
                self.measure()
            if stop_points and self.changes() >= stop_points[0]:
                stop_points.pop(0)
                self.driver_stop_and_rerun()
                continue
            before = self.changes()
            # Keep a few workers around: grow when small, shrink when large.
            size = len(self.members())
            action = "add" if size <= 1 else self.rng.choices(ACTIONS, weights)[0]
            if size >= 5 and action == "add":
                action = "remove"
            if not self.counts["badnet"] and self.changes() >= self.target // 3:
                action = "badnet"            # once in every run, whatever the seed
            if self.rng.random() < 0.25:
                self.reset_connections()
            self.act(action)
            deadline = time.monotonic() + 30
            while self.changes() == before and time.monotonic() < deadline:
                time.sleep(0.1)
        self.settle()
        self.measure()
        (self.out / "end").write_text("end")
        code = self.job.finish(timeout=600)
        return self.check(code, time.monotonic() - started)

    def check(self, code, seconds):
        job = self.job
        assert code == 0, job.output()[-4000:]
        finals = job.finals()
        assert len(finals) == finals[0]["size"], finals
        for key in ("params", "optimizer", "sampler", "step"):
            assert len({json.dumps(f[key]) for f in finals}) == 1, (key, finals)
        history = job.history()
        epochs = max(h[0] for h in history) + 1
        assert_exactly_once(history, epochs, SAMPLES)
        for stopped, resumed in self.stopped_at:
            assert stopped == resumed, self.stopped_at
        growth = None
        if len(self.resources) >= 2:
            first = next((r for r in self.resources if r[0] == self.resources[-1][0]), None)
            growth = resource_growth(first[2], self.resources[-1][2])
            assert growth["fds"] <= LIMITS["fds"] and growth["threads"] <= LIMITS["threads"] \
                and growth["rss"] <= LIMITS["rss"], (growth, self.resources)
        events = [json.loads(x) for x in self.events.read_text().splitlines() if x.strip()]
        kinds = {}
        for e in events:
            kinds[e["event"]] = kinds.get(e["event"], 0) + 1
        return {"changes": self.changes(), "seconds": seconds, "counts": self.counts,
                "events": kinds, "steps": len(history), "epochs": epochs,
                "final_size": finals[0]["size"], "stopped_at": self.stopped_at,
                "resources": self.resources, "growth": growth}


def lab_cuts(workdir, cuts):
    """In the network lab (where this machine allows namespaces): a job on two worker
    hosts whose driver loses its link ``cuts`` times, each time until the driver has
    seen every heartbeat stop at once, then gets it back. The job must finish with
    nobody evicted or blacklisted. Returns None where the lab is not available."""
    from support.netlab import Lab, lab_job, why_no_lab
    if why_no_lab():
        return None
    lab = Lab(Path(workdir) / "lab")
    try:
        driver, a, b = lab.host("driver"), lab.host("a"), lab.host("b")
        job = lab_job(Path(workdir) / "lab-job", lab, driver,
                      ["-np", "2", "-H", f"{a.addr}:1,{b.addr}:1", "--worker-timeout", "10"],
                      env={"JOB_HOLD": "3", "JOB_EPOCHS": "2"}).start()
        try:
            job.wait_step(3)
            for n in range(1, cuts + 1):
                lab.link_down(driver)
                job.wait_for(lambda: job.output().count("every heartbeat stopped") >= n,  # noqa: B023
                             f"cut {n} to be seen", timeout=120)
                lab.link_up(driver)
                job.wait_for(lambda: job.output().count("heartbeats are back") >= n,  # noqa: B023
                             f"the link to come back after cut {n}", timeout=180)
            job.release(3)
            code = job.finish()
        finally:
            if job.proc.poll() is None:
                job.proc.kill()
        job.assert_ok(code, epochs=2, final_size=2)
        out = job.output()
        assert "blacklisting" not in out and "sent no heartbeat" not in out, out[-4000:]
        return cuts
    finally:
        lab.close()


HOLDER_LOSSES = ((signal.SIGKILL, True), (signal.SIGTERM, False),
                 (signal.SIGTERM, True), (signal.SIGKILL, False))


def newest_checkpoint(directory):
    """The commit of the newest complete checkpoint in ``directory`` (-1: none)."""
    return max((int(p.stem.split("-")[1]) for p in Path(directory).glob("ckpt-*.json")),
               default=-1)


def holder_losses(workdir, times):
    """The loss of every worker that holds the training state during a scale-up, ``times``
    times, each in a job of its own (it ends or rolls back the job by design): SIGKILL or
    SIGTERM (a spot reclaim while an autoscaler adds nodes), with and without checkpoints,
    in turn. With a checkpoint, the job resumes from the newest one on disk when the holder
    was gone (no checkpointed commit lost) and finishes with every sample trained once;
    without, it stops with exit 1 and one line naming the last commit, at or above the one
    the holder reported, and the newcomer never trains from step 0. Returns
    {"resumed": n, "stopped": n}."""
    from support.holder_loss import lose_every_holder
    done = {"resumed": 0, "stopped": 0}
    for n in range(times):
        end, durable = HOLDER_LOSSES[n % len(HOLDER_LOSSES)]
        directory = Path(workdir) / f"holders.{n}"
        ckpt = directory / "ckpt"
        started = []
        try:
            job, old, beat = lose_every_holder(
                started, directory, ["--checkpoint-dir", str(ckpt)] if durable else [])
            wait_gone(job, old)
            if durable:
                newest = newest_checkpoint(ckpt)       # the holder wrote nothing after this
                job.release(12)
                code = job.finish()
                job.assert_ok(code, final_size=1)
                resumed = [int(c) for c in re.findall(
                    r"resumed from checkpoint \S+ \(commit (\d+)\)", job.output())]
                assert len(resumed) == 1 and resumed[0] == newest >= beat["durable"], \
                    (resumed, newest, beat, job.output()[-4000:])
                done["resumed"] += 1
            else:
                code = job.finish()
                out = job.output()
                last = out.strip().splitlines()[-1]
                stop = re.fullmatch(r"elasticrun: error: no surviving worker holds the training "
                                    r"state; the last commit was (\d+)", last)
                assert code == 1 and stop and int(stop[1]) >= beat["holds"], (beat, out[-4000:])
                assert not any(r["round"] > 1 for r in job.steps()), "trained from scratch"
                done["stopped"] += 1
        finally:
            kill_leftover_jobs(started)
    return done


def wait_gone(job, pid):
    job.wait_for(lambda: not proc_alive(pid), f"worker {pid} to be gone")


def rank0_phases(workdir, times, phase_s=20):
    """A rank-0-only phase (an evaluation) of ``phase_s`` seconds, longer than the job's
    --stall-timeout, ``times`` times, each in a job of its own (rank0_phase). Returns the
    number of jobs that stopped as promised and resumed once the flag was raised."""
    for n in range(times):
        rank0_phase(Path(workdir) / f"rank0.{n}", phase_s)
    return times


def rank0_phase(directory, phase_s):
    """The job must stop with one line naming the cause and the flag (after at most
    RANK_REPEAT_LIMIT blacklisted hosts, one more when a heartbeat lagged), and the same
    command with --stall-timeout raised above the phase must resume from the newest
    checkpoint on disk (no checkpointed commit lost) and finish with every sample
    trained once."""
    from elastic.runner.repeats import RANK_REPEAT_LIMIT
    ckpt = directory / "ckpt"
    started = []

    def command(stall_timeout, name):
        job = Job(directory / name, ["-np", "3", "--min-np", "2", "-H",
                                     "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                                     "--stall-timeout", str(stall_timeout),
                                     "--checkpoint-dir", str(ckpt)],
                  env={"JOB_RANK0_PHASE": f"12:{phase_s}", "JOB_EPOCHS": "6",
                       "ELASTIC_CHECKPOINT_LOCK_WAIT": "30"})
        started.append(job)
        return job

    try:
        first = command(4, "first")
        code = first.run()
        out = first.output()
        last = out.strip().splitlines()[-1]
        assert code == 1 and last.startswith("elasticrun: error: rank 0 failed on ") \
            and "raise --stall-timeout" in last, out[-4000:]
        assert out.count("blacklisting host") <= RANK_REPEAT_LIMIT + 1, out[-4000:]
        wait_unlocked(ckpt)
        newest = newest_checkpoint(ckpt)
        assert newest >= 10, newest                  # one is due every 10 commits
        rerun = command(phase_s * 3, "rerun")
        code = rerun.run()
        rerun.assert_ok(code, epochs=6)
        resumed = re.findall(r"resumed from checkpoint \S+ \(commit (\d+)\)", rerun.output())
        assert resumed and int(resumed[0]) == newest, (resumed, newest)
    finally:
        kill_leftover_jobs(started)


def driver_restarts(workdir, restarts, seed):
    """Joining mode (elasticrun --serve, three agents, as in examples/kubernetes/): the
    serving driver SIGKILLed ``restarts`` times at seeded random moments (in steady
    training after a random number of steps, or while it is still adopting the workers
    of the previous outage) and started again by the same command, with a random
    number of steps trained in each outage. The job must end exit 0 with every rank
    bitwise equal, every sample trained once, no step gone back and no worker
    started again: the same processes throughout. Returns {moment: count}."""
    from support.join_cluster import JoinJob
    from support.waits import wait_until
    rng = random.Random(seed)
    base = Path(workdir) / "driver-restarts"
    base.mkdir(parents=True, exist_ok=True)
    job = JoinJob(base, ["-np", "3", "--worker-timeout", "30", "--event-log",
                         str(base / "events.jsonl"), "--state-dir", str(base / "state"),
                         "--checkpoint-dir", str(base / "ckpt")],
                  env={"JOB_EPOCHS": "100000", "JOB_SAMPLES": str(SAMPLES),
                       "JOB_END_FILE": str(base / "out" / "end")})
    moments = {"steady": 0, "adopting": 0}

    def trained():
        return sum(1 for r in job.steps() if r["rank"] == 0)

    def train_on(steps, driver_alive=True):
        goal = trained() + steps
        wait = job.wait_for if driver_alive else \
            (lambda p, what: wait_until(p, what, output=job.output))
        wait(lambda: trained() >= goal, f"{steps} more steps")
    try:
        job.start()
        for name in ("node-a", "node-b", "node-c"):
            job.join(name)
        job.wait_step(2, size=3)
        mark = [0]                # where the newest driver's output begins

        def newest(text):
            return lambda: text in job.output()[mark[0]:]
        for n in range(restarts):
            outage = rng.randint(1, 10)
            if n and rng.random() < 0.3:
                moments["adopting"] += 1         # killed again within the adoption window
                outage = 0                       # (a round may be forming: no steps then)
            else:
                moments["steady"] += 1
                if n:
                    job.wait_for(newest("adopted worker(s) are back"), "the adoption")
                train_on(rng.randint(3, 30))
            job.proc.send_signal(signal.SIGKILL)
            job.proc.wait()
            job.close_log()
            train_on(outage, driver_alive=False)             # on, without a driver
            mark[0] = len(job.output())
            job.restart_driver()
            job.wait_for(newest("adopting"), "the adoption to begin")
        job.wait_for(newest("adopted worker(s) are back"), "the last adoption")
        train_on(3)
        (job.out / "end").write_text("end")
        code = job.finish(timeout=600)
        finals = job.finals()
        assert code == 0 and len(finals) == 3, job.output()[-4000:]
        for key in ("params", "optimizer", "sampler", "step"):
            assert len({json.dumps(f[key]) for f in finals}) == 1, (key, finals)
        history = job.history()
        assert_exactly_once(history, max(h[0] for h in history) + 1, SAMPLES)
        assert len(list(job.out.glob("env.*.json"))) == 3, "a worker was started again"
        by_worker = {}
        for r in sorted(job.steps(), key=lambda r: r["t"]):
            by_worker.setdefault(r["worker"], []).append(r["step"])
        assert all(s == sorted(s) for s in by_worker.values()), "a committed step was lost"
        for name in ("node-a", "node-b", "node-c"):
            assert job.wait_agent(name) == 0, job.agent_output(name)
        return moments
    finally:
        job.cleanup()


def table(summary):
    r = summary["resources"]
    lines = ["| what | count |", "|---|---|"]
    lines.append(f"| membership changes (rounds published, reruns included) | "
                 f"{summary['changes']} |")
    for action, n in summary["counts"].items():
        lines.append(f"| fault: {action} | {n} |")
    for kind in ("worker_failed", "worker_evicted", "host_preempted", "worker_removed",
                 "host_blacklisted", "host_restored", "job_stopped"):
        lines.append(f"| event: {kind} | {summary['events'].get(kind, 0)} |")
    faults = summary["counts"]
    unplanned = summary["events"].get("worker_evicted", 0) - faults["stop"] - faults["stuck"]
    lines.append(f"| evictions beyond the SIGSTOP and stuck faults (a loaded machine) | "
                 f"{max(unplanned, 0)} |")
    lines.append(f"| committed steps / epochs (exactly once each) | {summary['steps']} / "
                 f"{summary['epochs']} |")
    lines.append(f"| driver stops: commit stopped at = commit resumed from | "
                 f"{', '.join(f'{a} = {b}' for a, b in summary['stopped_at']) or '-'} |")
    lines.append(f"| final world size, every rank bitwise equal | {summary['final_size']}, yes |")
    if summary["growth"]:
        last_run = r[-1][0]
        first, last = next(x for x in r if x[0] == last_run)[2], r[-1][2]   # one process
        g = summary["growth"]
        lines.append(f"| long-lived worker fds / threads / RSS, first change -> end | "
                     f"{first['fds']} -> {last['fds']} ({g['fds']:+d}) / {first['threads']} -> "
                     f"{last['threads']} ({g['threads']:+d}) / {first['rss'] / 2**20:.0f} -> "
                     f"{last['rss'] / 2**20:.0f} MiB ({g['rss']:.2f}x) |")
    if summary.get("holder_losses"):
        h = summary["holder_losses"]
        lines.append(f"| every holder lost in a scale-up: resumed from the newest checkpoint / "
                     f"stopped naming the last commit | {h['resumed']} / {h['stopped']} |")
    if summary.get("rank0_phases"):
        lines.append(f"| rank-0 phase > --stall-timeout: stopped naming the flag, rerun with it "
                     f"raised resumed from the newest checkpoint | {summary['rank0_phases']} |")
    if summary.get("driver_restarts") is not None:
        lines.append(f"| joining mode: serving driver SIGKILLed and restarted (adopted, same "
                     f"workers), by moment | {summary['driver_restarts']} |")
    if summary.get("lab_cuts") is not None:
        lines.append(f"| lab: driver link cut and restored, nobody evicted | "
                     f"{summary['lab_cuts']} |")
    lines.append(f"| wall time | {summary['seconds']:.0f} s |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--changes", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", default=None, help="work directory (default: a fresh temp one)")
    p.add_argument("--lab-cuts", type=int, default=3,
                   help="driver link cuts in the network lab, where it is available (0: none)")
    p.add_argument("--holder-losses", type=int, default=4,
                   help="jobs that lose every holder of the state in a scale-up (0: none)")
    p.add_argument("--rank0-phases", type=int, default=2,
                   help="jobs with a rank-0 phase longer than --stall-timeout (0: none)")
    p.add_argument("--driver-restarts", type=int, default=4,
                   help="joining mode: serving driver SIGKILLs and restarts (0: none)")
    args = p.parse_args(argv)
    import tempfile
    workdir = args.dir or tempfile.mkdtemp(prefix="elastic-soak-")
    summary = Soak(workdir, args.changes, args.seed, still_s=GROUP_BACKSTOP_S + 5).run()
    summary["driver_restarts"] = driver_restarts(workdir, args.driver_restarts, args.seed) \
        if args.driver_restarts else None
    summary["lab_cuts"] = lab_cuts(workdir, args.lab_cuts) if args.lab_cuts else None
    summary["holder_losses"] = holder_losses(workdir, args.holder_losses)
    summary["rank0_phases"] = rank0_phases(workdir, args.rank0_phases)
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
