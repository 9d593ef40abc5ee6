"""`make bench-net`: sync and training on shaped links between hosts of their own.

On loopback every "link" is a memory copy on the same 2 cores, so striping and
pipelining cannot show what they buy. Here each host is a network namespace of
the lab in tests/support/netlab.py (a veth to one bridge), its link rate-limited with
``tc tbf`` (this kernel has no netem, so no latency is added), and the workers
of benchmarks/dp_worker.py run one per namespace, gloo on each namespace's eth0,
the stand-in driver's control store in a namespace of its own. Each row's baseline
is measured in the same run on the same links.

    sudo make bench-net          # BENCH_NET_RATE=300mbit, BENCH_NET_REPS=3 (defaults)
    BENCH_NET_ROWS=sync,stripe python benchmarks/net_bench.py

Rows: sync (one newcomer vs the link rate and a raw gloo broadcast), stripe (1, 2, 3
holders whose uplinks are the limit, the receiver's link unshaped), chain (3 newcomers:
one chain vs 3 separate transfers), ddp (DistributedOptimizer vs torch DDP at the rate),
raw (the unshaped links: what the CPUs can drive, which decides the rate to use), pauses
(a real elasticrun in the store's namespace reaching the hosts through the lab's ssh shim:
a SIGKILL of 1 of 4 workers, and discovery growing the job 2 -> 4).
Where namespaces are refused it prints one line and exits 0. Everything it makes
(namespaces, qdiscs on their links) goes with the lab; the machine's own
namespace is never touched.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import pause_timeline  # noqa: E402
from common import BENCH, REPO, median  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from support import netlab  # noqa: E402

RATE = os.environ.get("BENCH_NET_RATE", "300mbit")
REPS = int(os.environ.get("BENCH_NET_REPS", "3"))
MODEL = os.environ.get("BENCH_NET_MODEL", "mlp")     # 10M MLP + Adam: 120 MB, 60 chunks
ALL_ROWS = ("raw", "sync", "stripe", "chain", "ddp", "pauses")
T0 = time.monotonic()


def log(msg):
    sys.stderr.write(f"[bench-net {time.monotonic() - T0:6.1f}s] {msg}\n")
    sys.stderr.flush()


class NetLab:
    """A lab of one control-store host and ``n`` worker hosts; launch() runs
    dp_worker.py one rank per host through common.launch inside the store's namespace."""

    def __init__(self, n):
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-net-"))
        self.lab = netlab.Lab(self.tmp / "lab")
        try:
            self.ctl = self.lab.host("ctl")
            self.hosts = [self.lab.host(f"h{i}") for i in range(1, n + 1)]
        except BaseException:
            self.close()
            raise

    def shape(self, up=None, down=None, hosts=None):
        """The same rates on ``hosts`` (default: all); None: unshaped (tbf removed)."""
        for host in hosts or self.hosts:
            for ns, dev, rate in ((host.ns, "eth0", up), (self.lab.switch, host.port, down)):
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=30)
                if rate:
                    self.lab.shape(host, **({"up": rate} if dev == "eth0" else {"down": rate}))

    def launch(self, n, args, timeout=900):
        spec = {"n": n, "args": list(args), "addr": self.ctl.addr, "timeout": timeout,
                "ns": [h.ns for h in self.hosts[:n]], "addr0": self.hosts[0].addr}
        done = subprocess.run([*self.ctl.prefix(), sys.executable, __file__, "--inner",
                               json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout + 60, cwd=str(REPO), env=common.base_env())
        if done.returncode != 0:
            raise RuntimeError(f"dp_worker {' '.join(args)} x{n} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def close(self):
        self.lab.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def inner(spec):
    """In the control store's namespace: round 1 of the ranks, one per host namespace."""
    res = common.launch(BENCH / "dp_worker.py", spec["n"], spec["args"], timeout=spec["timeout"],
                        addr=spec["addr"], prefixes=[["ip", "netns", "exec", ns]
                                                     for ns in spec["ns"]],
                        env={"GLOO_SOCKET_IFNAME": "eth0", "BENCH_DDP_ADDR": spec["addr0"]})
    print(json.dumps(res))


# -- rows -----------------------------------------------------------------------------------
ROWS, NOTES = [], []


def row(metric, got, baseline, ratio, target="—", met="—"):
    ROWS.append((metric, got, baseline, ratio, target, met))


def mbit(nbytes, s):
    return nbytes * 8 / s / 1e6


def yes(ok, why=""):
    return "yes" if ok else ("**no**" + (f": {why}" if why else ""))


def bench_raw(lab, rate_bits):
    lab.shape()
    s = lab.launch(2, ["sync", f"reps={REPS}", f"model={MODEL}"])[1]["sync"]
    n = s["bytes"]
    b, e = median(s["bcast_s"]), median(s["sync_s"])
    row(f"unshaped links (veth + bridge, 2 hosts), {n / 1e6:.1f} MB: raw gloo broadcast / "
        "newcomer sync (what these CPUs can drive)", f"{mbit(n, e):.0f} Mbit/s (sync)",
        f"{mbit(n, b):.0f} Mbit/s (broadcast)", f"rate used: {rate_bits / 1e6:.0f} Mbit/s = "
        f"{rate_bits / (n * 8 / b):.2f}× the unshaped broadcast",
        "rate ≤ 0.5× unshaped", yes(rate_bits <= 0.5 * n * 8 / b,
                                    "the CPUs, not the link, may bound the shaped rows"))
    NOTES.append(f"raw: unshaped per-repeat ms sync {[round(x * 1e3) for x in s['sync_s']]}, "
                 f"broadcast {[round(x * 1e3) for x in s['bcast_s']]}")


def bench_sync(lab, rate_bits):
    lab.shape(up=RATE, down=RATE)
    s = lab.launch(2, ["sync", f"reps={REPS}", f"model={MODEL}"])[1]["sync"]
    n = s["bytes"]
    e, f = median(s["sync_s"]), median(s["bcast_fresh_s"])
    eff = n * 8 / e / rate_bits
    row(f"newcomer sync, {n / 1e6:.1f} MB, 1 holder → 1 newcomer, both links {RATE}: effective "
        "bandwidth vs the link rate; vs a raw gloo broadcast into fresh memory",
        f"{mbit(n, e):.0f} Mbit/s ({e * 1e3:.0f} ms)",
        f"link {rate_bits / 1e6:.0f} Mbit/s; broadcast {mbit(n, f):.0f} Mbit/s ({f * 1e3:.0f} ms)",
        f"{eff:.2f}× link; {f / e:.2f}× broadcast", "≥ 0.9× link", yes(eff >= 0.9))
    NOTES.append(f"sync at {RATE}: per-repeat ms {[round(x * 1e3) for x in s['sync_s']]}, raw "
                 f"broadcast into fresh memory {[round(x * 1e3) for x in s['bcast_fresh_s']]}, "
                 f"into touched memory {[round(x * 1e3) for x in s['bcast_s']]}")


def bench_stripe(lab, rate_bits):
    lab.shape(up=RATE, down=RATE, hosts=lab.hosts[:3])
    lab.shape(up=RATE, down=None, hosts=lab.hosts[3:4])      # the receiver's link: unshaped
    res = lab.launch(4, ["sync", f"reps={REPS}", f"model={MODEL}", "holders=3", "ks=1:2:3"])
    s = res[3]["sync"]
    n = s["bytes"]
    one = median(s["by_k"]["1"])
    for k in (1, 2, 3):
        t = median(s["by_k"][str(k)])
        gain = one / t
        shares = [median(r["sync"]["sent"][str(k)]) / 1e6 for r in res[:3]]
        row(f"striping, {n / 1e6:.1f} MB to 1 newcomer from {k} holder(s), holders' uplinks "
            f"{RATE}, the newcomer's link unshaped: gain vs 1 holder",
            f"{t * 1e3:.0f} ms ({mbit(n, t):.0f} Mbit/s; sent MB "
            f"{' + '.join(f'{x:.1f}' for x in shares[:k])})", f"1 holder {one * 1e3:.0f} ms",
            f"{gain:.2f}×", f"≥ {0.8 * k:.1f}×", yes(gain >= 0.8 * k) if k > 1 else "—")
    NOTES.append("striping: per-repeat ms " + "; ".join(
        f"{k} holder(s) {[round(x * 1e3) for x in s['by_k'][str(k)]]}" for k in (1, 2, 3)))


def bench_chain(lab, rate_bits):
    lab.shape(up=RATE, down=RATE)
    res = lab.launch(4, ["sync", f"reps={REPS}", f"model={MODEL}", "holders=1", "separate=1"])
    s = res[3]["sync"]
    n = s["bytes"]
    per_rep = [sum(t) for t in zip(*(r["sync"]["separate_s"] for r in res[1:]))]
    e, sep, f = median(s["sync_s"]), median(per_rep), median(s["bcast_fresh_s"])
    row(f"3 newcomers at once, {n / 1e6:.1f} MB, 1 holder, every link {RATE}: one pipelined "
        "chain (to its end) vs 3 separate transfers from the holder; raw gloo broadcast to 3 "
        "ranks into fresh memory in brackets",
        f"{e * 1e3:.0f} ms ({mbit(n, e) / rate_bits * 1e6:.2f}× link)",
        f"{sep * 1e3:.0f} ms [{f * 1e3:.0f} ms]", f"{sep / e:.2f}× [{f / e:.2f}×]",
        "≥ 2.4× (0.8 × 3)", yes(sep / e >= 2.4))
    NOTES.append(f"chain: per-repeat ms {[round(x * 1e3) for x in s['sync_s']]}, 3 separate "
                 f"{[round(x * 1e3) for x in per_rep]}")


def bench_ddp(lab, rate_bits):
    lab.shape(up=RATE, down=RATE)
    reps = max(6, 2 * REPS)
    r0 = lab.launch(2, ["steady", f"reps={reps}", "steps=2", "kinds=mlp", "batch=16",
                        "edp=1"])[0]
    d = r0["mlp"]
    bs = d["step_s"]["ddp"]
    wire = d["wire_bytes_per_step"]
    for side, what in (("elastic.DDP", "elastic.DDP (torch DDP on the round's group)"),
                       ("elastic", "elastic.DistributedOptimizer")):
        es = d["step_s"][side]
        ratio = median([b / e for e, b in zip(es, bs)])
        row(f"steady state at {RATE}, MLP {d['params'] / 1e6:.1f}M params, 2 hosts, batch 16: "
            f"{what} vs torch DDP on a gloo group of its own (same processes and links, "
            "interleaved)", f"{median(es) * 1e3:.0f} ms/step", f"{median(bs) * 1e3:.0f} ms/step",
            f"{ratio:.2f}× throughput (gradient {wire / 1e6:.0f} MB/step: "
            f"{wire * 8 / (rate_bits * 0.956):.2f} s of link per step for a 2-rank allreduce)",
            "≥ 0.97×", yes(ratio >= 0.97))
    NOTES.append("ddp: per-repeat ms/step " + "; ".join(
        f"{k} {[round(x * 1e3) for x in v]}" for k, v in d["step_s"].items()))


def bench_pauses(lab, rate_bits):
    """A real elasticrun in the store's namespace, workers on h1..h4 through the lab's ssh
    shim (job_worker.py, tiny model): a SIGKILL of 1 of 4, and discovery adding 2 hosts."""
    import run
    lab.shape(up=RATE, down=RATE)
    shim = lab.lab.ssh_shim(lab.ctl)
    env = {"PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "BENCH_STEP_SLEEP": "0.01"}
    base = ["--network-interface", "eth0", "--remote-python", sys.executable]
    every = ",".join(f"{h.addr}:1" for h in lab.hosts)
    log_crash, log_grow = lab.tmp / "crash-events.jsonl", lab.tmp / "grow-events.jsonl"
    with run.Job(base + ["--event-log", str(log_crash), "-np", "4", "--min-np", "2", "-H",
                         every], env={**env, "BENCH_KILL": "40:3"},
                 prefix=lab.ctl.prefix()) as job:
        rec, detail = run.one_recovery(job)
        stages = pause_timeline.crash(json.loads((job.out / "kill.json").read_text()),
                                      job.steps(), job.events(), common.read_jsonl(
                                          lab.tmp, log_crash.name))
    row(f"crash pause at {RATE}: SIGKILL 1 of 4 workers (one per host) → every "
        "survivor completed its next step", f"{rec:.2f} s", "—", "—", "≤ 0.2 s",
        yes(rec <= 0.2))
    NOTES.append(f"crash at {RATE}: {detail}; s after the kill: {stages}")
    two = [f"{h.addr}:1" for h in lab.hosts[:2]]
    with run.Job(base + ["--event-log", str(log_grow), "-np", "2", "--min-np", "2"],
                 hosts=two, env=env, prefix=lab.ctl.prefix()) as job:
        job.wait_for(lambda: any(r["step"] >= 30 for r in job.steps()), "step 30", timeout=300)
        job.set_hosts(two + [f"{h.addr}:1" for h in lab.hosts[2:]])
        job.wait_for(lambda: len([r for r in job.steps() if r["size"] == 4]) >= 4 * 20,
                     "20 steps at 4 workers", timeout=300)
        job.finish(timeout=120)
        steps, events = job.steps(), job.events()
    first = min(r["round"] for r in steps)
    new = min(r["round"] for r in steps if r["size"] == 4)
    stages = pause_timeline.scale_up(steps, events, common.read_jsonl(
        lab.tmp, log_grow.name), first, new)
    gaps = []
    for rank in (0, 1):
        before = max(r["t"] for r in steps if r["round"] == first and r["rank"] == rank)
        after = min(r["t"] for r in steps if r["round"] == new and r["rank"] == rank)
        gaps.append(after - before)
    r0 = sorted(r["t"] for r in steps if r["round"] == first and r["rank"] == 0)
    step = median([b - a for a, b in zip(r0, r0[1:])][-20:])
    row(f"scale-up pause at {RATE}: 2 → 4 workers (discovery adds 2 hosts): the survivors' "
        "last step before the change to their first step after it", f"{max(gaps):.2f} s",
        f"a step {step * 1e3:.0f} ms", "—", "≤ 0.1 s", yes(max(gaps) <= 0.1))
    NOTES.append(f"scale-up at {RATE}: pauses {[round(g, 3) for g in gaps]} s; s after the "
                 f"survivors' last step: {stages}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--inner":
        inner(json.loads(sys.argv[2]))
        return
    reason = netlab.why_no_lab()
    if reason:
        print(f"bench-net skipped: {reason}")
        return
    if shutil.which("tc") is None:
        print("bench-net skipped: tc (iproute2) is not installed")
        return
    rate_bits = netlab.tc_rate_bits(RATE)
    only = [r for r in os.environ.get("BENCH_NET_ROWS", ",".join(ALL_ROWS)).split(",") if r]
    lab = NetLab(4)
    try:
        for name in only:
            log(f"{name} ...")
            try:
                globals()[f"bench_{name}"](lab, rate_bits)
            except Exception as exc:  # noqa: BLE001 - one failed row must not hide the rest
                log(f"{name} failed: {exc}")
                row(f"{name}: FAILED", f"{type(exc).__name__}: {str(exc)[-300:]}", "—", "—")
            log(f"{name} done")
    finally:
        lab.close()
    load = os.getloadavg()
    head = ["metric", "elastic", "baseline", "ratio", "target", "met?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in ROWS]
    text = (f"Hosts: network namespaces on one bridge, links shaped with tc tbf to {RATE} "
            f"(no added latency: no netem here), model {MODEL} + Adam, medians of {REPS} "
            f"repeats; {os.cpu_count()} cores, load average {load[0]:.1f} at the end; total "
            f"{time.monotonic() - T0:.0f} s.\n\n" + "\n".join(lines) + "\n\nNotes:\n"
            + "\n".join(f"- {n}" for n in NOTES) + "\n")
    print("\n" + text)
    (BENCH / "results-net.md").write_text("# `make bench-net` results\n\n" + text)


if __name__ == "__main__":
    main()
