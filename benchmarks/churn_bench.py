"""Goodput under churn, rows of `make bench` (`BENCH_ONLY=churn` / `churnmix`).

A real elasticrun job of job_worker.py on 4 single-slot loopback hosts (discovery
lists them), a commit every step. After a warm-up at full size, one fault every
``EVERY_S`` for ``WINDOW_S``: ``churn`` SIGKILLs a random training worker each time;
``churnmix`` cycles SIGKILL, SIGTERM (its host leaves discovery and comes back, as a
spot reclaim and replacement), SIGSTOP, a stuck training thread, a host removed and
added back. The driver brings every lost slot back (blacklist cooldown 1-2 s).

goodput = committed steps in the window × the median full-size step ÷ the window's
wall time. The loss is split by walking rank 0's step records through the window:
each interval between two steps is one median step of useful work plus an excess,
and the excess is put where it belongs: a round change (pauses), a step done again
after a rollback (rolled back), a step that ran while a replacement was starting
(respawn CPU: its python imports torch on the same 2 cores), or any other slow step.
A smaller world shows in the sample-weighted goodput beside it (each step counts
size / 4 of a full one).
"""

import json
import os
import random
import signal
import time

from common import median

HOSTS = [f"127.0.0.{i}:1" for i in range(2, 6)]
WINDOW_S = float(os.environ.get("BENCH_CHURN_WINDOW", "90"))
EVERY_S = 10.0
MIX = ("kill", "term", "stop", "remove", "stuck", "add", "kill", "term", "kill")
# --worker-timeout and --stall-timeout: a SIGSTOPped worker or a stuck thread costs this
# much by design before anything can act (30 of this job's 33 ms steps; the defaults are
# 30 s and 600 s). No live worker was evicted at this setting: its runs changed rounds as
# often as at 1.5 s. BENCH_CHURN_DETECT=1.5 (or 5) gives the figure at an earlier one.
DETECT_S = float(os.environ.get("BENCH_CHURN_DETECT", "1.0"))


def _last_step_times(job):
    """wid -> time of its newest step record."""
    out = {}
    for p in job.out.glob("steps.*.jsonl"):
        lines = p.read_text().splitlines()
        for line in reversed(lines):
            try:
                out[p.name.split(".")[1]] = json.loads(line)["t"]
                break
            except ValueError:
                continue
    return out


def _training(job):
    """{wid: start record} of workers that completed a step in the last second."""
    now = time.time()
    starts = {p.name.split(".", 1)[1]: json.loads(p.read_text())
              for p in job.out.glob("start.*")}
    return {w: starts[w] for w, t in _last_step_times(job).items()
            if now - t < 1.0 and w in starts}


def _fault(job, kind, rng, listed, log):
    live = _training(job)
    if kind == "add":
        missing = [h for h in HOSTS if h not in listed]
        if missing:
            listed.append(missing[0])
            job.set_hosts(listed)
        return "add " + (missing[0] if missing else "(none missing)")
    if not live:
        return f"{kind}: no training worker"
    wid = rng.choice(sorted(live))
    pid, host = live[wid]["pid"], live[wid].get("host")
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
    elif kind == "stop":
        os.kill(pid, signal.SIGSTOP)
    elif kind == "stuck":
        (job.out / f"stuck.{wid}").write_text("")
    elif kind == "term":        # a spot reclaim: SIGTERM, its host leaves, a new one comes
        os.kill(pid, signal.SIGTERM)
        entry = next((h for h in listed if h.split(":")[0] == host), None)
        if entry:
            listed.remove(entry)
            job.set_hosts(listed)
    elif kind == "remove":
        entry = next((h for h in listed if h.split(":")[0] == host), None)
        if entry:
            listed.remove(entry)
            job.set_hosts(listed)
    return f"{kind} {wid} on {host}"


def run_churn(Job, kinds, quick=False, spare=False):  # noqa: N803 - run.Job, passed in
    """One churn run (``spare``: elasticrun --warm-spare); returns (analysis dict, list of
    fault descriptions)."""
    rng = random.Random(1)
    window = 30.0 if quick else WINDOW_S
    detect = DETECT_S if "stop" in kinds else 5.0    # SIGKILLs are seen as exits, not by it
    args = ["-np", "4", "--min-np", "2", "--blacklist-cooldown-range", "1", "2",
            "--worker-timeout", str(detect), "--stall-timeout", str(detect)] + (
                ["--warm-spare"] if spare else [])
    done = []
    with Job(args, hosts=list(HOSTS), env={"BENCH_STEP_SLEEP": "0.02",
                                           "BENCH_MAX_STEPS": "100000"}) as job:
        listed = list(HOSTS)
        job.wait_for(lambda: len([r for r in job.steps() if r["size"] == 4]) >= 4 * 40,
                     "40 steps at 4 workers", timeout=240)
        t0 = time.time()
        for i in range(int(window // EVERY_S)):
            while time.time() < t0 + i * EVERY_S:
                time.sleep(0.02)
            kind = kinds[i % len(kinds)]
            done.append((round(time.time() - t0, 1), _fault(job, kind, rng, listed, None)))
            if kind == "term":         # its replacement host shows up 2 s later
                pending = [h for h in HOSTS if h not in listed]
                while time.time() < t0 + i * EVERY_S + 2:
                    time.sleep(0.02)
                listed.extend(pending[:1])
                job.set_hosts(listed)
        while time.time() < t0 + window:
            time.sleep(0.05)
        t1 = time.time()
        job.set_hosts(list(HOSTS))
        starts = {p.name.split(".", 1)[1]: json.loads(p.read_text())
                  for p in job.out.glob("start.*")}
        for p in job.out.glob("start.*"):   # SIGCONT the stopped, so the driver can end
            try:
                os.kill(json.loads(p.read_text())["pid"], signal.SIGCONT)
            except (ProcessLookupError, KeyError, ValueError):
                pass
        steps, events, output = job.steps(), job.events(), job.output()
        first = {}
        for p in job.out.glob("steps.*.jsonl"):
            line = p.read_text().split("\n", 1)[0]
            if line.strip():
                first[p.name.split(".")[1]] = json.loads(line)["t"]
        try:
            job.finish(timeout=120)
        except RuntimeError:
            pass      # an unclean end does not change what was trained in the window
    if os.environ.get("BENCH_CHURN_DUMP"):     # the raw records, to look into a run
        with open(os.environ["BENCH_CHURN_DUMP"], "w") as f:
            json.dump({"steps": steps, "starts": starts, "first": first, "t0": t0, "t1": t1,
                       "faults": done, "events": events, "driver": output}, f)
    ready = {e["wid"]: e["t"] for e in events if e["what"] == "ready_to_join"}
    hangs = [t0 + t for t, d in done if d.startswith(("stop ", "stuck "))]
    return analyse(steps, starts, first, t0, t1, ready, hangs), done


def analyse(steps, starts, first, t0, t1, ready=None, hangs=()):
    """``first``: wid -> its first step's time (a replacement's start ends there);
    ``ready``: wid -> when it reached @elastic.run (its imports and set-up done);
    ``hangs``: when a worker was SIGSTOPped or its thread stuck (the interval holding one
    is detection, by design, plus its round change)."""
    r0 = sorted((r for r in steps if r["rank"] == 0 and t0 <= r["t"] <= t1), key=lambda r: r["t"])
    pairs = list(zip(r0, r0[1:]))
    med = median([b["t"] - a["t"] for a, b in pairs if a["round"] == b["round"]])
    full = median([b["t"] - a["t"] for a, b in pairs if a["round"] == b["round"]
                   and b["size"] == 4]) or med
    spawns = [(s["t_start"], first.get(w, t1)) for w, s in starts.items() if s["t_start"] > t0]
    parts = {"pauses": 0.0, "rolled back": 0.0, "respawn CPU": 0.0, "other": 0.0}
    if hangs:
        parts = {"detection": 0.0, **parts}
    rolled, changes, samples = 0, 0, 0.0
    for a, b in pairs:
        excess = (b["t"] - a["t"]) - med
        if b["step"] <= a["step"]:
            redo = a["step"] - b["step"] + 1
            rolled += redo
            parts["rolled back"] += redo * med
        if b["round"] != a["round"]:
            changes += 1
            held = any(a["t"] - 0.1 <= h < b["t"] for h in hangs)   # fault times: 0.1 s
            parts["detection" if held else "pauses"] += excess
        elif any(s < b["t"] and a["t"] < e for s, e in spawns):
            parts["respawn CPU"] += excess
        else:
            parts["other"] += excess
        samples += b["size"] / 4
    wall = r0[-1]["t"] - r0[0]["t"]
    progress = r0[-1]["step"] - r0[0]["step"]
    ready = ready or {}
    late = [w for w, s in starts.items() if s["t_start"] > t0]
    return {"goodput": progress * med / wall, "median_step": med, "full_step": full,
            "by_samples": (samples - rolled) * full / wall, "wall": wall, "steps": progress,
            "rolled": rolled, "changes": changes, "respawned": len(late),
            "loss": {k: v / wall for k, v in parts.items()},
            "import_s": median([starts[w]["t_imported"] - starts[w]["t_start"] for w in late]),
            "setup_s": median([ready[w] - starts[w]["t_imported"] for w in late if w in ready]),
            "sizes": {n: sum(1 for _a, b in pairs if b["size"] == n) for n in (1, 2, 3, 4)}}


def rows(Job, quick=False, mixed=False):  # noqa: N803
    """The row without and with --warm-spare (BENCH_CHURN_SPARE=0 or 1: only that one)."""
    only = os.environ.get("BENCH_CHURN_SPARE")
    got, notes = [], []
    for spare in (False, True):
        if only is not None and spare != (only == "1"):
            continue
        g, n = _row(Job, quick, mixed, spare)
        got += g
        notes += n
    return got, notes


def _row(Job, quick, mixed, spare):  # noqa: N803
    kinds = MIX if mixed else ("kill",)
    a, done = run_churn(Job, kinds, quick, spare)
    what = ("mixed faults (SIGKILL, SIGTERM + host replaced, SIGSTOP, stuck thread, host "
            "removed and added)" if mixed else "a random worker SIGKILLed")
    flag = ", --warm-spare" if spare else ""
    target = 0.95 if mixed else 0.98
    loss = ", ".join(f"{k} {100 * v:.1f} %" for k, v in a["loss"].items())
    detect = (f", --worker-timeout and --stall-timeout {DETECT_S:g} s (detection: the "
              "interval holding a SIGSTOP or a stuck thread)" if mixed else "")
    got = [(f"goodput under churn{flag}: {what} every {EVERY_S:.0f} s for {a['wall']:.0f} s, 4 "
            f"single-slot hosts, --min-np 2{detect}, commit every step: committed steps × "
            "median step "
            "÷ wall time; the loss split; sample-weighted (a step of n workers counts n/4 of a "
            "full-size step) after it",
            f"{100 * a['goodput']:.1f} % ({a['steps']} steps × {a['median_step'] * 1e3:.0f} ms "
            f"in {a['wall']:.1f} s); loss: {loss}; sample-weighted {100 * a['by_samples']:.1f} %",
            "no faults: 100 %", f"{a['goodput']:.3f}", f"≥ {100 * target:.0f} %",
            "yes" if a["goodput"] >= target else "**no**: see notes")]
    notes = [f"churn ({'mixed' if mixed else 'SIGKILL'}{flag}): faults at " + "; ".join(
        f"+{t} s {d}" for t, d in done) + f"; {a['changes']} round changes, {a['rolled']} "
        f"steps rolled back; steps by world size 1/2/3/4: "
        f"{'/'.join(str(a['sizes'][n]) for n in (1, 2, 3, 4))} (full-size step "
        f"{a['full_step'] * 1e3:.0f} ms); {a['respawned']} replacements, each (median) "
        f"{a['import_s'] or 0:.1f} s from exec to `import torch` done, then "
        f"{a['setup_s'] or 0:.1f} s to @elastic.run (the optimizer's first use imports "
        "torch._dynamo) on the loaded 2 cores: a slot stays empty that long"]
    return got, notes
