"""A status snapshot (runner/status.py) as the text `elasticctl status` and `top` print."""

from __future__ import annotations

from typing import Any

ROUNDS_PRINTED = 5


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{s:02d}s" if hours else f"{minutes}m{s:02d}s"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _number(value: object, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _table(rows: list[tuple[Any, ...]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def render(status: dict[str, Any], label: str) -> str:
    job = status["job"]
    limit = "no max" if job["max_np"] is None else f"max {job['max_np']}"
    state = "stopping" if job["stopping"] else job["phase"]
    lines = [f"job {label}: round {job['round']}, {job['size']} workers (min {job['min_np']}, "
             f"{limit}), {state}, up {_duration(job['uptime_s'])}, store {job['store']}"]
    progress = status.get("progress")
    if progress:
        extra = ", ".join(f"{k} {_number(v)}" for k, v in sorted(progress.items())
                          if k not in ("step", "rate", "at", "age_s", "round"))
        rate = progress.get("rate")
        lines.append(f"progress: step {progress.get('step', '-')}"
                     + (f", {rate:.2f} steps/s" if rate is not None else "")
                     + (f", {extra}" if extra else "")
                     + f" ({_duration(progress.get('age_s'))} ago)")
    else:
        lines.append("progress: none reported yet (elastic.report_progress)")
    pause = status.get("last_pause")
    lines.append("last pause: " + (f"round {pause['round']}, {pause['seconds']:.3f} s"
                                   if pause else "none yet"))
    lines.append("checkpoint: " + _checkpoint(status.get("checkpoint")))
    counts = status.get("counts") or {}
    lines.append("counts: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in (
        "rounds", "pauses", "failures", "evicted", "preempted", "drained")))
    lines.append("")
    rows = [("RANK", "WORKER", "HOST", "STATE", "COMMITS", "COMMITS/S", "LAST COMMIT",
             "COMMIT S", "SYNC S")]
    for m in status["members"]:
        rows.append((m["rank"], m["worker_id"], m["host"], m.get("state", "-"),
                     _number(m.get("commits")), _number(m.get("commit_rate"), 3),
                     "-" if m.get("last_commit_s") is None
                     else f"{_duration(m['last_commit_s'])} ago",
                     _number(m.get("commit_s"), 3), _number(m.get("sync_s"), 3)))
    lines += _table(rows) if len(rows) > 1 else ["no round yet"]
    others = status.get("other_workers") or []
    if others:
        lines.append("other workers: " + ", ".join(
            f"{w['worker_id']} on {w['host']} ({w['state']})" for w in others))
    lines.append("")
    hosts = status["hosts"]
    lines.append("hosts: " + (", ".join(f"{h} ({n} slots)" for h, n in hosts["slots"].items())
                              or "none available"))
    barred = hosts["blacklisted"]
    lines.append("blacklisted: " + (", ".join(
        f"{b['host']} ({b['failures']} failures, "
        + ("never returns" if b["returns_in_s"] is None
           else f"returns in {_duration(b['returns_in_s'])}") + ")" for b in barred) or "none"))
    lines.append("drained: " + (", ".join(hosts["drained"]) or "none")
                 + "; preempted: " + (", ".join(hosts["preempted"]) or "none"))
    failure = status.get("last_failure")
    if failure:
        lines.append(f"last failure: {failure['reason']}")
    rounds = status.get("rounds") or []
    if rounds:
        lines.append("recent rounds:")
        for r in rounds[-ROUNDS_PRINTED:]:
            paused = "" if r.get("pause_s") is None else f", paused {r['pause_s']:.3f} s"
            lines.append(f"  round {r['round']}: {r['size']} workers ({r['change']}){paused}")
    return "\n".join(lines)


def _checkpoint(state: dict[str, Any] | None) -> str:
    if state is None:
        return "no --checkpoint-dir"
    newest = state.get("newest")
    if newest is None:
        return f"{state['dir']}: none visible from the driver yet"
    return (f"{state['dir']}: commit {newest['version']}, {_bytes(newest['bytes'])}, "
            f"written {_duration(newest['age_s'])} ago")
