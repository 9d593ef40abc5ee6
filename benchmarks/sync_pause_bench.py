"""The survivors' pause when a newcomer needs 120 MB of state (`BENCH_ONLY=syncpause`).

The span is the one the README names: from the survivors' last step before the
change to their first step after it (the first step after includes one ordinary
step, shown beside it). A real elasticrun job of job_worker.py with the 10M MLP and
Adam (BENCH_MODEL=mlp10m) on localhost:2; discovery adds 127.0.0.1:1 (one newcomer),
then removes it, ``adds`` times. The baseline, measured in the same run: a raw gloo
broadcast of the same number of bytes into fresh memory between 2 processes
(dp_worker.py sync: the receiver allocates, then receives, page faults included).
"""

import json

import common
from common import BENCH, median


def one_job(Job, adds):  # noqa: N803 - run.Job, passed in (no import cycle)
    base, grown = ["localhost:2"], ["localhost:2", "127.0.0.1:1"]
    with Job(["-np", "2", "--min-np", "2"], hosts=base,
             env={"BENCH_MODEL": "mlp10m", "BENCH_STEP_SLEEP": "0"}) as job:
        def at_size(n, count):
            return lambda: len([r for r in job.steps() if r["size"] == n]) >= count
        job.wait_for(at_size(2, 2 * 20), "20 steps at 2 workers", timeout=240)
        for i in range(adds):
            job.set_hosts(grown)
            job.wait_for(at_size(3, 3 * 8 * (i + 1)), "8 steps at 3 workers", timeout=240)
            job.set_hosts(base)
            job.wait_for(at_size(2, 2 * (20 + 8 * (i + 1))), "8 steps at 2 again", timeout=240)
        job.finish(timeout=120)
        return pauses(job.steps(), job.events())


def pauses(steps, events):
    """[(pause, step before, transfer seconds, bytes received)] for each admission."""
    rounds = sorted({(r["round"], r["size"]) for r in steps})
    out = []
    for (old, old_size), (new, new_size) in zip(rounds, rounds[1:]):
        if not (old_size == 2 and new_size == 3):
            continue
        gaps = []
        for rank in (0, 1):
            before = [r["t"] for r in steps if r["round"] == old and r["rank"] == rank]
            after = [r["t"] for r in steps if r["round"] == new and r["rank"] == rank]
            if before and after:
                gaps.append(min(after) - max(before))
        r0 = sorted(r["t"] for r in steps if r["round"] == old and r["rank"] == 0)
        step = median([b - a for a, b in zip(r0, r0[1:])][-10:])
        ends = [e for e in events if e["what"] == "sync_end" and e["round"] == new
                and e.get("received")]
        starts = [e["t"] for e in events if e["what"] == "sync_start" and e["round"] == new]
        transfer = max(e["t"] for e in ends) - max(starts) if ends and starts else None
        out.append((max(gaps), step, transfer, sum(e["received"] for e in ends)))
    return out


def rows(Job, quick=False):  # noqa: N803
    got = one_job(Job, 2 if quick else 3)
    raw = common.launch(BENCH / "dp_worker.py", 2, ["sync", "reps=3"], timeout=400)[1]["sync"]
    bcast, nbytes = median(raw["bcast_fresh_s"]), raw["bytes"]
    pause, step = median([g[0] for g in got]), median([g[1] for g in got])
    transfer = median([g[2] for g in got])
    moved = median([g[3] for g in got])
    ratio, alone = pause / bcast, (pause - step) / bcast
    row = ("sync to a newcomer, 10M MLP + Adam, elasticrun on loopback, 2 → 3 workers: the "
           "survivors' pause (their last step before the change to their first step after it, "
           "the README's span) vs a raw gloo broadcast of the same bytes into fresh memory; "
           "the pause less one ordinary step in brackets",
           f"{pause * 1e3:.0f} ms [{(pause - step) * 1e3:.0f} ms] (the newcomer received "
           f"{moved / 1e6:.1f} MB in {transfer * 1e3:.0f} ms; a step {step * 1e3:.0f} ms)",
           f"{bcast * 1e3:.0f} ms ({nbytes / 1e6:.1f} MB)", f"{ratio:.2f}× [{alone:.2f}×]",
           "≤ 1.2×", "yes" if ratio <= 1.2 else (
               "**no**" + (f": without the step it contains, {alone:.2f}×" if alone <= 1.2
                           else ": see notes")))
    note = ("sync pause, per admission (pause ms, step ms, transfer ms, MB): "
            + json.dumps([[round(p * 1e3), round(s * 1e3), round((t or 0) * 1e3),
                           round(b / 1e6, 1)] for p, s, t, b in got])
            + f"; raw broadcast into fresh memory ms {[round(x * 1e3) for x in raw['bcast_fresh_s']]}")
    return [row], [note]
