"""Jobs with an event log, and the loss of every worker that holds the state during a
scale-up: what tests/test_repeat_faults.py and the soak share."""

import json
import os
import signal

from elastic import protocol as control
from elastic.protocol import ControlStore, Keys
from support.jobs import Job
from support.procs import job_workers
from support.waits import wait_until


def events(job):
    path = job.dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logged_job(started, tmp_path, args, env, hosts=None):
    job = Job(tmp_path, ["--event-log", str(tmp_path / "events.jsonl")] + args,
              hosts=hosts, env=env)
    started.append(job)
    return job


def lose_every_holder(started, tmp_path, args=(), env=None, end=signal.SIGKILL):
    """One worker trains and holds at step 12; it is SIGSTOPped before it can sync anyone,
    a host is added, and once round 2 (old worker and newcomer) is published, the old
    worker gets ``end``: only the newcomer, which holds nothing, is left. Returns the job,
    the old worker's pid and its last heartbeat before the SIGSTOP (what the driver knew)."""
    job = logged_job(started, tmp_path, ["-np", "1", "--min-np", "1"] + list(args),
                     dict({"JOB_HOLD": "12", "JOB_SECRET_OUT": "1"}, **(env or {})),
                     hosts=["127.0.0.1:1"])
    job.start()
    job.wait_step(12)
    (old, env), = job_workers(job.out).items()
    # What the driver will know: the holder's heartbeat (read with the job's secret, as the
    # driver does) reports the commit it holds, and the checkpoint it wrote, if any.
    wid = env["ELASTIC_WORKER_ID"]
    # The workers' key, as the worker wrote it down (JOB_SECRET_OUT): it is no longer
    # in its environment.
    key = (job.out / f"secret.{wid}").read_bytes()
    store = ControlStore(control.connect("127.0.0.1", env[control.ENV_PORT], 30), key)
    durable = 10 if "--checkpoint-dir" in args else -1
    wait_until(lambda: (store.get(Keys.heartbeat(wid)) or {}).get("holds", -1) >= 12
               and store.get(Keys.heartbeat(wid)).get("durable", -1) >= durable,
               "a heartbeat that reports the state held (and the checkpoint)", 120)
    beat = store.get(Keys.heartbeat(wid))
    os.kill(old, signal.SIGSTOP)
    job.set_hosts(["127.0.0.1:1", "127.0.0.2:1"])
    job.wait_for(lambda: any(e["event"] == "round_started" and e["round"] == 2
                             for e in events(job)), "round 2 published")
    os.kill(old, end)
    if end != signal.SIGKILL:
        os.kill(old, signal.SIGCONT)          # a spot reclaim: it leaves at its next commit
    return job, old, beat
