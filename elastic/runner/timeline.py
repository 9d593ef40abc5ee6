"""Draw an event log as a timeline: `python -m elastic.runner.timeline events.jsonl -o timeline.png`.

World size over time as a step line, each pause as a shaded span, failures
and evictions as red marks. matplotlib is an optional extra
(`pip install elastic-train[report]`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from elastic.streams import read_json_lines


def load(path: str) -> list[Any]:
    """The events of ``path``; ValueError names a line that is not JSON."""
    return read_json_lines(path, strict=True)


def timeline(events: Sequence[Mapping[str, Any]],
             ) -> tuple[list[tuple[float, int]], list[tuple[float, float]], list[tuple[float, str]]]:
    """(sizes, pauses, failures) with times in seconds since the first event."""
    if not events:
        return [], [], []
    t0 = events[0]["time"]
    sizes: list[tuple[float, int]] = []
    pauses: list[tuple[float, float]] = []
    failures: list[tuple[float, str]] = []
    for e in events:
        t = e["time"] - t0
        if e["event"] == "round_started":
            sizes.append((t, e["size"]))
        elif e["event"] == "pause":
            pauses.append((t, e["seconds"]))
        elif e["event"] in ("worker_failed", "worker_evicted"):
            failures.append((t, e.get("host", "")))
        elif e["event"] in ("job_finished", "job_failed") and sizes:
            sizes.append((t, sizes[-1][1]))
    return sizes, pauses, failures


def draw(events: Sequence[Mapping[str, Any]], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes, pauses, failures = timeline(events)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    if sizes:
        ax.step([t for t, _ in sizes], [n for _, n in sizes], where="post", color="tab:blue",
                linewidth=2, label="workers")
    for t, seconds in pauses:
        ax.axvspan(t - seconds, t, color="tab:orange", alpha=0.4)
        ax.annotate(f"{seconds:.2f} s", (t, 0.2), fontsize=8, color="tab:orange")
    for t, host in failures:
        ax.plot([t], [0.5], "x", color="red", markersize=10)
        ax.annotate(host, (t, 0.6), fontsize=8, color="red")
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("world size")
    ax.set_ylim(bottom=0)
    ax.set_title("elastic job timeline (orange: training paused, red: failures)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elastic.runner.timeline",
                                     description="Draw an elasticrun --event-log file.")
    parser.add_argument("event_log")
    parser.add_argument("-o", "--output", default="timeline.png")
    args = parser.parse_args(argv)
    try:
        events = load(args.event_log)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"elastic.runner.timeline: error: {exc}\n")
        return 2
    try:
        draw(events, args.output)
    except ImportError:
        sys.stderr.write("elastic.runner.timeline: error: matplotlib is needed: "
                         "pip install 'elastic-train[report]'\n")
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
