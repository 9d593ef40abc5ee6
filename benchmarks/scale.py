"""`make scale`: the real driver against N simulated workers (benchmarks/scale_sim.py).

For each N (256, 1,024 and 4,096 by default) it starts the driver in its own
process with N single-slot hosts, waits for the first round to assemble, then
measures:

* steady state over ``--steady`` seconds: the driver process's CPU (its event
  loop and the TCPStore it hosts, which serves every heartbeat and look), and
  store requests per second from the driver and all workers together;
* a join (a host added to discovery), a leave (a host removed) and a crash (a
  worker exits 1): the time from the change to the new round's ``round_assembled``
  event, and what each worker read from the store to join that round.

Usage: python benchmarks/scale.py [--sizes 256,1024,4096] [--steady 10]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import scale_sim  # noqa: E402
from elastic.runner.driver import Driver, JobConfig  # noqa: E402

COMMIT_S = 0.25          # how often a simulated worker commits (one training step)
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def driver_main(hosts_file, event_log, stats_file, commands, exits, n):
    """The driver's process: elasticrun's Driver with the simulated cluster."""
    logging.basicConfig(level=logging.WARNING, format="driver: %(message)s")
    cluster = scale_sim.SimCluster(hosts_file, commands, exits)
    config = JobConfig(command=["simulated"], discovery=cluster, backend=cluster, np=n,
                       min_np=1, discovery_interval=0.2, event_log=event_log,
                       worker_timeout=120, start_timeout=600, elastic_timeout=600)
    driver = Driver(config)

    def report():
        while True:
            control = getattr(driver, "control", None)
            if control is not None:
                tmp = stats_file + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({"requests": control.requests, "bytes_read": control.bytes_read}, f)
                os.replace(tmp, stats_file)
            time.sleep(0.5)

    import threading
    threading.Thread(target=report, daemon=True).start()
    profile = os.environ.get("ELASTIC_SCALE_PROFILE")
    try:
        if profile:                       # diagnosis: SIGTERM the driver to write it
            import cProfile

            from elastic.runner.driver import install_signal_handlers
            install_signal_handlers(driver)
            cProfile.runctx("driver.run()", globals(), {"driver": driver}, profile)
        else:
            driver.run()
    except BaseException:
        import traceback
        traceback.print_exc()             # os._exit below would swallow it
        raise
    finally:
        os._exit(0)


class Run:
    """One driver and its simulated cluster of ``n`` single-slot hosts."""

    def __init__(self, n, workdir, processes=None):
        self.n = n
        self.dir = Path(workdir)
        self.hosts_file = str(self.dir / "hosts.json")
        self.event_log = str(self.dir / "events.jsonl")
        self.stats_file = str(self.dir / "driver-stats.json")
        self.hosts = {f"sim-{i}": 1 for i in range(n)}
        self.write_hosts()
        ctx = mp.get_context("fork")
        k = processes or max(1, min(8, n // 512))
        self.commands = [ctx.Queue() for _ in range(k)]
        self.exits, self.reports = ctx.Queue(), ctx.Queue()
        self.sims = [ctx.Process(target=scale_sim.sim_main, daemon=True,
                                 args=(q, self.exits, self.reports, COMMIT_S))
                     for q in self.commands]
        for p in self.sims:
            p.start()
        self.driver = ctx.Process(target=driver_main, daemon=True, args=(
            self.hosts_file, self.event_log, self.stats_file, self.commands, self.exits, n))
        self.driver.start()
        self._offset, self._events, self._started_line = 0, [], None

    def write_hosts(self):
        tmp = self.hosts_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.hosts, f)
        os.replace(tmp, self.hosts_file)

    def _read_events(self):
        """New whole lines of the event log since the last call. The harness shares the
        2 cores with the driver and the workers: re-reading and parsing the whole log
        (its round_started lines name every member) every 20 ms cost it a third of a
        core, so it reads only what was appended and parses the big lines on demand."""
        if not os.path.exists(self.event_log):
            return
        with open(self.event_log, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        for line in chunk[:end].splitlines():
            if b'"event": "round_started"' in line:
                self._started_line = line            # only the latest one is asked for
            elif line.strip():
                self._events.append(json.loads(line))

    def events(self):
        """The log's events, except round_started (see current_round)."""
        self._read_events()
        return self._events

    def wait_assembled(self, size, after_round, timeout):
        """The first round after ``after_round`` that assembled with ``size`` members:
        (its event, when this process saw it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if e["event"] == "round_assembled" and e["round"] > after_round \
                        and e["size"] == size:
                    return e, time.monotonic()
                if e["event"] == "job_failed":
                    raise RuntimeError(f"the job failed: {e['reason']}")
            if not self.driver.is_alive():
                raise RuntimeError("the driver exited")
            time.sleep(0.02)
        raise RuntimeError(f"no round of {size} assembled within {timeout:.0f} s")

    def current_round(self):
        self._read_events()
        return json.loads(self._started_line) if self._started_line else None

    def sim_cpu(self):
        """CPU seconds the simulated processes used so far, together."""
        return sum(cpu_seconds(p.pid) for p in self.sims if p.is_alive())

    def driver_stats(self):
        with open(self.stats_file) as f:
            return json.load(f)

    def worker_stats(self):
        """Totals and the joins since the last call, from every simulated process."""
        for q in self.commands:
            q.put(("stats",))
        parts = [self.reports.get(timeout=120) for _ in self.commands]
        return {"requests": sum(p["requests"] for p in parts),
                "bytes_read": sum(p["bytes_read"] for p in parts),
                "joins": [j for p in parts for j in p["joins"]]}

    def close(self):
        for p in [self.driver, *self.sims]:
            if p.is_alive():
                p.kill()
        for p in [self.driver, *self.sims]:
            p.join(10)


def _join_costs(joins, round_id):
    rows = [j for j in joins if j[1] == round_id]
    if not rows:
        return None
    return {"workers": len(rows),
            "bytes_median": statistics.median(j[3] for j in rows),
            "bytes_max": max(j[3] for j in rows),
            "requests_median": statistics.median(j[2] for j in rows)}


def measure(n, steady_s=10.0, timeout=None, processes=None):
    """The figures for one N (see the module docstring), as a dict."""
    timeout = timeout or max(120.0, n / 10)
    out = {"n": n}
    with tempfile.TemporaryDirectory(prefix="elastic-scale-") as tmp:
        run = Run(n, tmp, processes)
        try:
            started = time.monotonic()
            first, _ = run.wait_assembled(n, 0, timeout)
            out["start_s"] = time.monotonic() - started
            run.worker_stats()
            time.sleep(min(2.0, steady_s))            # let the start-up traffic settle

            # Steady state: nothing changes.
            d0, w0, c0, t0 = run.driver_stats(), run.worker_stats(), cpu_seconds(
                run.driver.pid), time.monotonic()
            time.sleep(steady_s)
            d1, w1, c1, t1 = run.driver_stats(), run.worker_stats(), cpu_seconds(
                run.driver.pid), time.monotonic()
            out["driver_cpu"] = (c1 - c0) / (t1 - t0)
            out["store_rps"] = (d1["requests"] - d0["requests"] + w1["requests"]
                                - w0["requests"]) / (t1 - t0)
            out["driver_read_bps"] = (d1["bytes_read"] - d0["bytes_read"]) / (t1 - t0)
            last = first["round"]

            def change(what, size, act):
                nonlocal last
                t, sims, driver = time.monotonic(), run.sim_cpu(), cpu_seconds(run.driver.pid)
                wall = time.time()
                act()
                event, seen = run.wait_assembled(size, last, timeout)
                out[f"{what}_s"] = seen - t
                started = run.current_round()      # the newest round_started line
                out[f"{what}_published_s"] = (started["time"] - wall
                                              if started["round"] == event["round"] else None)
                out[f"{what}_assembly_s"] = event["seconds"]
                # On a cluster each worker's part runs on its own machine; here all of
                # them share this machine's cores with the driver.
                out[f"{what}_sim_cpu_s"] = run.sim_cpu() - sims
                out[f"{what}_driver_cpu_s"] = cpu_seconds(run.driver.pid) - driver
                time.sleep(COMMIT_S * 4)             # the last joins are reported
                out[f"{what}_joins"] = _join_costs(run.worker_stats()["joins"], event["round"])
                last = event["round"]

            def join():
                run.hosts[f"sim-{n}"] = 1
                run.write_hosts()

            def leave():
                del run.hosts["sim-0"]
                run.write_hosts()

            def crash():
                members = run.current_round()["members"]
                victim = next(m for m in members if m["host"] == "sim-1")
                run.commands[scale_sim.sim_of("sim-1", len(run.commands))].put(
                    ("crash", victim["worker_id"]))

            change("join", n + 1, join)
            change("leave", n, leave)
            change("crash", n - 1, crash)
            out["rounds"] = [e["size"] for e in run.events() if e["event"] == "round_assembled"]
            out["plan_bytes_before"] = _whole_plan_bytes(run.current_round()["members"])
        finally:
            run.close()
    return out


def _whole_plan_bytes(members):
    """What one worker read per round before the header and per-member entries:
    the whole plan (about this many bytes of JSON, before the seal)."""
    full = [dict(m, size=len(members), local_rank=0, local_size=1, cross_rank=0,
                 cross_size=len(members)) for m in members]
    return len(json.dumps({"round": 1, "members": full}, sort_keys=True))


def secs(x):
    """``x`` seconds, or "—" when not measured (a newer round started meanwhile)."""
    return "—" if x is None else f"{x:.2f} s"


def print_cpu_table(rows):
    print("| N | change | change → assembled | change → plan published | the round's "
          "assembly | store requests per worker to join (median) | CPU used meanwhile: "
          f"driver / simulated workers (cores: {os.cpu_count()}) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for what in ("join", "leave", "crash"):
            joins = r.get(what + "_joins") or {}
            print(f"| {r['n']} | {what} | {r[what + '_s']:.2f} s | "
                  f"{secs(r[what + '_published_s'])} | {r[what + '_assembly_s']:.2f} s "
                  f"| {joins.get('requests_median', 0):.0f} "
                  f"| {r[what + '_driver_cpu_s']:.2f} s / {r[what + '_sim_cpu_s']:.2f} s |")


def print_table(rows):
    print("| N | join → assembled | leave → assembled | crash → assembled | driver CPU, "
          "steady | store requests/s, steady | bytes read per worker per round (median / "
          "max) | a whole plan (before) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        joins = r.get("crash_joins") or r.get("join_joins") or {}
        print(f"| {r['n']} | {r['join_s']:.2f} s | {r['leave_s']:.2f} s | {r['crash_s']:.2f} s "
              f"| {100 * r['driver_cpu']:.1f} % of a core | {r['store_rps']:.0f} "
              f"| {joins.get('bytes_median', 0):.0f} / {joins.get('bytes_max', 0):.0f} B "
              f"| {r['plan_bytes_before']} B |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256,1024,4096")
    parser.add_argument("--steady", type=float, default=10.0)
    args = parser.parse_args(argv)
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        row = measure(n, steady_s=args.steady)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print_table(rows)
    print()
    print_cpu_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
