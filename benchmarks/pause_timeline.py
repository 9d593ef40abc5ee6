"""Where a round change's pause goes: stages read from a job's own records.

The records are job_worker.py's (steps, events: restore, interrupt, groups_start,
groups_end, sync_end) and the driver's ``--event-log`` (worker_failed, worker_ready,
round_started), all stamped with time.time() on one machine. Each stage is the
moment the *last* survivor (or the driver) passed it, in seconds after the start of
the pause, so consecutive stages read as where the time went.
"""


def _last(records, what, round_id=None, wids=None):
    ts = [r["t"] for r in records if r["what"] == what
          and (round_id is None or r["round"] == round_id) and (wids is None or r["wid"] in wids)]
    return max(ts) if ts else None


def _driver(events, name, after, round_id=None):
    ts = [e["time"] for e in events if e["event"] == name and e["time"] >= after
          and (round_id is None or e.get("round") == round_id)]
    return min(ts) if ts else None


def _chain(t0, stages):
    return ", ".join(f"{name} {t - t0:+.3f}" for name, t in stages if t is not None)


def crash(kill, steps, events, driver_events):
    """The stages of a crash pause, after the SIGKILL: the survivors noticed (restore),
    the driver decided (worker_failed) and published the new round, every member arrived
    (its group starts forming), the group formed and checked, state synced, stepped."""
    t0 = kill["t"]
    after = [r for r in steps if r["round"] > kill["round"]]
    new = min(r["round"] for r in after)
    wids = {r["wid"] for r in events if r["round"] == new}
    firsts = {}
    for r in after:
        if r["round"] == new:
            firsts[r["rank"]] = min(firsts.get(r["rank"], r["t"]), r["t"])
    failed = [e for e in driver_events if e["event"] == "worker_failed" and e["time"] >= t0]
    stages = [("noticed", _last(events, "restore", kill["round"], wids)),
              ("driver decided", min(e["time"] for e in failed) if failed else None),
              ("published", _driver(driver_events, "round_started", t0, new)),
              ("all arrived", _last(events, "groups_start", new)),
              ("group formed", _last(events, "groups_end", new)),
              ("synced", _last(events, "sync_end", new)),
              ("stepped", max(firsts.values()) if firsts else None)]
    how = failed[0].get("reason", "") if failed else ""
    return _chain(t0, stages) + (f" (the driver learnt it from: {how})" if how else "")


def scale_up(steps, events, driver_events, first, new, survivors=(0, 1)):
    """The stages of a scale-up pause, after the survivors' last step in round ``first``:
    the newcomers ready (driver), round ``new`` published, the survivors' commit saw it
    (interrupt), every member arrived, the group formed, the newcomers synced, stepped."""
    lasts = [max(r["t"] for r in steps if r["round"] == first and r["rank"] == k)
             for k in survivors]
    t0 = min(lasts)
    ready = [e["time"] for e in driver_events if e["event"] == "worker_ready"]
    firsts = [min(r["t"] for r in steps if r["round"] == new and r["rank"] == k)
              for k in survivors]
    stages = [("newcomers ready", max(ready) if ready else None),
              ("published", _driver(driver_events, "round_started", 0, new)),
              ("commit saw it", _last(events, "interrupt", first)),
              ("all arrived", _last(events, "groups_start", new)),
              ("group formed", _last(events, "groups_end", new)),
              ("synced", _last(events, "sync_end", new)),
              ("stepped", max(firsts))]
    return _chain(t0, stages)
