"""The survivors' pause when a newcomer needs 120 MB of state (`BENCH_ONLY=syncpause`).

The pause is the span the README names: from the end of the survivors' last step
before the change to the start of their first step after it, the time in which no
training happened (the worker, job_worker.py, stamps each step's start and end).
It holds the last commit before the change (where the change is learnt), the
round's re-forming, the sync and what runs before the loop body starts again; a
second row shows how much longer the first step after the change took than the
median step at the new size, so work the change left inside that step (lazy
connections, first use of the new group) is not hidden.

A real elasticrun job of job_worker.py with the 10M MLP and Adam (BENCH_MODEL=mlp10m)
on localhost:2; discovery adds 127.0.0.1:1 (one newcomer), then removes it,
``adds`` times. The baseline, measured in the same run: a raw gloo broadcast of the
same number of bytes into fresh memory between 2 processes (dp_worker.py sync: the
receiver allocates, then receives, page faults included), 3 times before the job and
3 times after it (the median of the 6).
"""

import json
import os

import common
from common import BENCH, median


def one_job(Job, adds):  # noqa: N803 - run.Job, passed in (no import cycle)
    base, grown = ["localhost:2"], ["localhost:2", "127.0.0.1:1"]
    with Job(["-np", "2", "--min-np", "2"], hosts=base,
             env={"BENCH_MODEL": "mlp10m", "BENCH_STEP_SLEEP": "0"}) as job:
        def at_size(n):
            return len([r for r in job.steps() if r["size"] == n])

        def steps_from_now(n, more):     # each change waits for steps of its own
            count = at_size(n) + more
            return lambda: at_size(n) >= count
        job.wait_for(steps_from_now(2, 2 * 20), "20 steps at 2 workers", timeout=240)
        for _ in range(adds):
            ready = steps_from_now(3, 3 * 8)
            job.set_hosts(grown)
            job.wait_for(ready, "8 steps at 3 workers", timeout=240)
            ready = steps_from_now(2, 2 * 8)
            job.set_hosts(base)
            job.wait_for(ready, "8 steps at 2 again", timeout=240)
        job.finish(timeout=120)
        return pauses(job.steps(), job.events())


def _event(events, what, wid, round_id, pick=max):
    ts = [e["t"] for e in events if e["what"] == what and e["wid"] == wid
          and e["round"] == round_id]
    return pick(ts) if ts else None


def pauses(steps, events):
    """One dict per admission (2 -> 3 workers): the slowest survivor's pause (end of
    its last step before the change to the start of its first step after it) and
    its parts, that step's length against the median step at 3 workers, the
    ordinary gap between two steps before the change, and the newcomer's transfer."""
    rounds = sorted({(r["round"], r["size"]) for r in steps})
    out = []
    for (old, old_size), (new, new_size) in zip(rounds, rounds[1:]):
        if not (old_size == 2 and new_size == 3):
            continue
        before = [r for r in steps if r["round"] == old]
        after = [r for r in steps if r["round"] == new]
        survivors = {r["wid"] for r in before} & {r["wid"] for r in after}
        per = []
        for wid in sorted(survivors):
            last = max((r for r in before if r["wid"] == wid), key=lambda r: r["t"])
            first = min((r for r in after if r["wid"] == wid), key=lambda r: r["t_start"])
            marks = [last["t"], _event(events, "interrupt", wid, old),
                     _event(events, "sync_start", wid, new, min),
                     _event(events, "sync_end", wid, new), first["t_start"]]
            per.append({"pause": first["t_start"] - last["t"],
                        "first_step": first["t"] - first["t_start"],
                        "parts": [None if a is None or b is None else b - a
                                  for a, b in zip(marks, marks[1:])]})
        firsts = {min((r for r in after if r["wid"] == w), key=lambda r: r["t_start"])["step"]
                  for w in {r["wid"] for r in after}}
        ordinary = median([r["t"] - r["t_start"] for r in after if r["step"] not in firsts])
        r0 = sorted((r for r in before if r["rank"] == 0), key=lambda r: r["t"])
        gap = median([b["t_start"] - a["t"] for a, b in zip(r0, r0[1:])][-10:])
        ends = [e for e in events if e["what"] == "sync_end" and e["round"] == new
                and e.get("received")]
        starts = [e["t"] for e in events if e["what"] == "sync_start" and e["round"] == new]
        slowest = max(per, key=lambda p: p["pause"])
        out.append({**slowest, "pauses": [p["pause"] for p in per], "step": ordinary,
                    "gap": gap, "received": sum(e["received"] for e in ends),
                    "transfer": max(e["t"] for e in ends) - max(starts)
                    if ends and starts else None})
    return out


def ms(s):
    return "—" if s is None else f"{s * 1e3:.0f} ms"


def rows(Job, quick=False):  # noqa: N803
    def raw_broadcasts():
        return common.launch(BENCH / "dp_worker.py", 2, ["sync", "reps=3"],
                             timeout=400)[1]["sync"]
    first_raw = raw_broadcasts()          # before and after the job: both see its load
    got = one_job(Job, 2 if quick else 3)
    raw = raw_broadcasts()
    raw["bcast_fresh_s"] = first_raw["bcast_fresh_s"] + raw["bcast_fresh_s"]
    load = os.getloadavg()
    bcast, nbytes = median(raw["bcast_fresh_s"]), raw["bytes"]
    mid = sorted(got, key=lambda g: g["pause"])[(len(got) - 1) // 2]   # the median admission
    pause, gap, parts = mid["pause"], mid["gap"], mid["parts"]
    transfer, moved = mid["transfer"], mid["received"]
    first, step = median([g["first_step"] for g in got]), median([g["step"] for g in got])
    extra = median([g["first_step"] - g["step"] for g in got])
    ratio = pause / bcast
    out = [("sync to a newcomer, 10M MLP + Adam, elasticrun on loopback, 2 → 3 workers: the "
            "survivors' pause, from the end of their last step before the change to the start "
            "of their first step after it (no training in between; the slowest survivor, the "
            "median admission), vs a raw gloo broadcast of the same bytes into fresh memory",
            f"{ms(pause)} = last commit {ms(parts[0])} + re-forming {ms(parts[1])} + sync "
            f"{ms(parts[2])} + to the step {ms(parts[3])} (the newcomer received "
            f"{moved / 1e6:.1f} MB in {ms(transfer)}; the ordinary gap between two steps, "
            f"a commit, {ms(gap)})",
            f"{ms(bcast)} ({nbytes / 1e6:.1f} MB)", f"{ratio:.2f}×", "≤ 1.2×",
            "yes" if ratio <= 1.2 else "**no**: see the parts"),
           ("the same admissions: the survivors' first step after the change vs their median "
            "step at 3 workers (work the change left inside the step)",
            f"{ms(first)} (+{ms(extra)}: the median of the differences)", ms(step),
            f"{first / step:.2f}×",
            "report", "—")]
    note = ("sync pause, per admission: " + json.dumps([{
        "pause_ms": round(g["pause"] * 1e3), "survivors_ms": [round(p * 1e3) for p in g["pauses"]],
        "parts_ms": [None if p is None else round(p * 1e3) for p in g["parts"]],
        "first_step_ms": round(g["first_step"] * 1e3), "median_step_ms": round(g["step"] * 1e3),
        "gap_ms": round(g["gap"] * 1e3), "transfer_ms": round((g["transfer"] or 0) * 1e3),
        "MB": round(g["received"] / 1e6, 1)} for g in got])
        + f"; raw broadcast into fresh memory ms {[round(x * 1e3) for x in raw['bcast_fresh_s']]}"
        " (3 before the job, 3 after)"
        f"; parts: end of the last step → the commit raised the change (the commit, with its "
        f"agreement) → sync began (the round re-formed) → sync ended → the loop body began; "
        f"load average {load[0]:.1f} (1 min) at the end")
    return out, [note]
