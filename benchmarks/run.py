"""`make bench`: every comparison side by side in one run, one markdown table.

Runs on loopback gloo with OMP_NUM_THREADS=1. Each comparison measures both
sides in the same run, interleaved where they share processes; numbers are
medians of a few repeats (this 2-core machine is small, shared and noisy).
The table is printed and written to benchmarks/results.md.

Sections (worker scripts in this folder):
  steady    dp_worker.py steady: DistributedOptimizer vs torch DDP, fp16 wire bytes
  commit    commit_bench.py: commit vs copy_ vs Horovod-style deepcopy (size 1)
  sync      dp_worker.py sync,scan,growth: newcomer sync vs raw broadcast, no-op sync,
            commit/sync vs model size, growth at 2 workers
  recovery  real elasticrun jobs of job_worker.py, one worker SIGKILLs itself
  restart   restart_worker.py: torchrun-style restart baseline
  scaleup   real elasticrun job, discovery adds a host while it trains
  growth    dp_worker.py growth at 4 and 8 workers
  ops       ops_bench.py: elastic.torch ops (with their pre-op check) vs unchecked collectives
  adascale  adascale_bench.py: LRScaler(rule="adascale") vs the linear rule, step time
  driverrestart  driver_restart_bench.py: a serving driver SIGKILLed and started again
  ddp       ddp_bench.py: elastic.DDP under elasticrun vs the same script under torchrun;
            a DDP job's change pause vs DistributedOptimizer's
  ckpt      ckpt_bench.py: durable checkpoints (size 1) in a temp dir under $BENCH_CKPT_DIR
            (default: the system temp dir): write throughput vs dd conv=fsync there, training
            stall per checkpoint, bytes written with half the model frozen
  syncpause sync_pause_bench.py: survivors' pause admitting a newcomer that needs 120 MB (end
            of their last step before the change to the start of their first step after
            it: the README's span) vs a raw broadcast of the same bytes into fresh memory;
            their first step after the change vs their median step
  churn     churn_bench.py: goodput while a random worker is SIGKILLed every 10 s for 90 s
  churnmix  churn_bench.py: the same with mixed faults (SIGTERM, SIGSTOP, stuck, hosts)
  spawn     spawn_bench.py: training steps' slowdown beside a newcomer's imports, started
            at SCHED_IDLE vs at normal priority
  fsdp      fsdp_bench.py: ShardedState (FSDP2) on 4 workers: bytes held per rank, commit
            with vs without redundancy, a 3 -> 4 reshard vs bytes moved / link bandwidth
  fsdpsteady  fsdp_steady.py: the same FSDP2 script with ShardedState under elasticrun vs
            plain under torchrun, steady throughput
  fsdpckpt  fsdp_ckpt_bench.py: bytes landed per sharded checkpoint in a real elasticrun
            FSDP2 job, half the layers frozen vs everything training (a full write)
BENCH_ONLY=steady,commit,... runs a subset (written to results-partial.md, so the full
table stays); BENCH_QUICK=1 uses fewer repeats; BENCH_STEADY_REPS sets the steady ones.
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import BENCH, REPO, median  # noqa: E402

QUICK = os.environ.get("BENCH_QUICK") == "1"
ROWS = []      # (metric, elastic, baseline, ratio, target, met)
NOTES = []
T0 = time.monotonic()


def log(msg):
    sys.stderr.write(f"[bench {time.monotonic() - T0:6.1f}s] {msg}\n")
    sys.stderr.flush()


def row(metric, elastic, baseline="—", ratio="—", target="—", met="—"):
    ROWS.append((metric, elastic, baseline, ratio, target, met))


def ms(s):
    return "—" if s is None else f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def us(s):
    return "—" if s is None else f"{s * 1e6:.0f} µs" if s < 1e-3 else ms(s)


def secs(s):
    return "—" if s is None else f"{s:.2f} s"


def mb(n):
    return f"{n / 1e6:.1f} MB"


def gbps(nbytes, s):
    return nbytes / s / 1e9


def yes(ok, why=""):
    return "yes" if ok else ("**no**" + (f": {why}" if why else ""))


def section(name):
    def deco(fn):
        def wrapped():
            log(f"{name} ...")
            t = time.monotonic()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - one failed section must not hide the rest
                traceback.print_exc()
                row(f"{name}: FAILED", f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
            log(f"{name} done in {time.monotonic() - t:.0f} s")
        return wrapped
    return deco


# -- 1. steady state ----------------------------------------------------------------------
@section("steady state")
def bench_steady():
    reps = int(os.environ.get("BENCH_STEADY_REPS", 5 if QUICK else 60))   # 20: too noisy here
    kinds = os.environ.get("BENCH_STEADY_KINDS", "mlp:cnn:deep")
    r0 = common.launch(BENCH / "dp_worker.py", 2, ["steady", f"reps={reps}", "steps=2",
                                                     f"reps_cnn={2 * reps}",
                                                     f"reps_deep={2 * reps}", "batch=16",
                                                     f"kinds={kinds}"])[0]
    for kind, label in (("mlp", "MLP"), ("cnn", "small CNN"),
                        ("deep", "200 x Linear(64, 64)")):
        if kind not in r0:
            continue
        d = r0[kind]
        es, bs = d["step_s"]["elastic"], d["step_s"]["ddp"]
        e, b = median(es), median(bs)
        pairs = [bi / ei for ei, bi in zip(es, bs)]  # each pair ran back to back
        ratio = median(pairs)
        q1, _, q3 = statistics.quantiles(pairs, n=4)
        row(f"steady state, {label} {d['params'] / 1e6:.2f}M params, 2 workers, batch 16: "
            "throughput vs torch DDP", f"{1 / e:.2f} steps/s ({ms(e)})",
            f"{1 / b:.2f} steps/s ({ms(b)})", f"{ratio:.2f}× (IQR {q1:.2f}–{q3:.2f})", "≥ 0.97×",
            yes(ratio >= 0.97, f"within this shared machine's noise: the paired ratios' IQR "
                f"reaches {q3:.2f}" if q3 >= 0.97 else "see notes"))
        NOTES.append(f"steady {label}: {len(es)} interleaved repeats of 2 steps; step time "
                     f"min/median/max elastic {ms(min(es))}/{ms(e)}/{ms(max(es))}, DDP "
                     f"{ms(min(bs))}/{ms(b)}/{ms(max(bs))}; ratio = median of the back-to-back "
                     f"pairs; elastic used {d['buckets']} bucket(s) of ≤25 MB")
    if "mlp" not in r0:
        return
    d = r0["mlp"]
    ratio = d["wire_bytes_fp16_per_step"] / d["wire_bytes_per_step"]
    row("fp16 compression: gradient bytes on the wire per step (MLP)",
        f"{mb(d['wire_bytes_fp16_per_step'])}", f"{mb(d['wire_bytes_per_step'])} (none)",
        f"{ratio:.2f}×", "0.5×", yes(abs(ratio - 0.5) < 0.01))


# -- 2. commit ----------------------------------------------------------------------------
@section("commit")
def bench_commit():
    r = common.run_script(BENCH / "commit_bench.py", ["5" if QUICK else "9", "steps"])
    t = {k: median(v) for k, v in r["times"].items()}
    what = f"{mb(r['bytes'])}: 10M MLP + Adam state"
    ratio = t["elastic"] / t["copy_"]
    row(f"commit {what}, standalone: state.commit() vs plain copy_ into preallocated buffers",
        f"{ms(t['elastic'])} ({gbps(r['bytes'], t['elastic']):.1f} GB/s)",
        f"{ms(t['copy_'])} ({gbps(r['bytes'], t['copy_']):.1f} GB/s)", f"{ratio:.2f}×",
        "≤ 1.3×", yes(ratio <= 1.3))
    speed = t["deepcopy"] / t["elastic"]
    cold = r["times"]["deepcopy"]
    row(f"commit {what}: state.commit() vs Horovod-style deepcopy of both state_dicts",
        ms(t["elastic"]), f"{ms(t['deepcopy'])} ({gbps(r['bytes'], t['deepcopy']):.1f} GB/s)",
        f"{speed:.1f}× faster", "≥ 3× faster",
        yes(speed >= 3, f"only the first deepcopy pays page faults ({ms(r['first']['deepcopy'])}"
            f", {r['first']['deepcopy'] / t['elastic']:.0f}× a commit); later ones reuse the pages "
            "glibc kept from the copy they replace, leaving only allocation and Python overhead"))
    restore = median(r["restore_s"])
    NOTES.append(f"restore() of the same state (after a failure, before rejoining): "
                 f"{ms(restore)} = {restore / t['elastic']:.1f}× a commit "
                 "(load_state_dict copies the model part from the snapshot; the optimizer state "
                 "and values are cloned into fresh memory, or, on a newcomer's first restore, "
                 "into the arena it touched before admission)")
    NOTES.append("sync pack() of 1.6 MB split into 250 / 1000 / 4000 tensors: " + " / ".join(
        ms(v) for v in r["pack_s"].values()) + " (offsets recomputed per tensor: quadratic)")
    NOTES.append("commit: a training step runs before every timed copy; first (cold) ms: "
                 + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r["first"].items()))
    NOTES.append("commit: per-repeat ms elastic "
                 f"{[round(x * 1e3, 1) for x in r['times']['elastic']]}"
                 f", copy_ {[round(x * 1e3, 1) for x in r['times']['copy_']]}, deepcopy "
                 f"{[round(x * 1e3, 1) for x in cold]}")


# -- 3. sync, 6. growth and the model-size scan (all harness-run gloo groups) --------------
GROWTH = {}


@section("sync + model-size scan + growth at 2 workers")
def bench_sync():
    reps = 3 if QUICK else 5
    sizes = "1:10" if QUICK else "1:10:100"
    res = common.launch(BENCH / "dp_worker.py", 2,
                        ["sync,scan,growth", f"reps={reps}", f"sizes={sizes}"], timeout=400)
    r0, r1 = res
    s = r1["sync"]                       # times on the receiver (rank 1, the newcomer)
    n = s["bytes"]
    e, f, b = median(s["sync_s"]), median(s["bcast_fresh_s"]), median(s["bcast_s"])
    ratio = f / e
    pack = median([p.get("pack", 0) for p in r0["sync"]["phases"]])
    cpu_e = median([p["cpu"] for p in s["phases"]])
    cpu_f, cpu_b = median(s["bcast_fresh_cpu_s"]), median(s["bcast_cpu_s"])
    into = sorted({str(p.get("received_into")) for p in s["phases"]})
    copied = sorted({str(p.get("copied_into")) for p in s["phases"]})
    row(f"sync to a newcomer, {mb(n)} (10M MLP + Adam), 2 workers: effective bandwidth "
        "on the receiver vs raw gloo broadcast of one buffer of that size into fresh memory "
        "(into touched memory in brackets); the receiver's CPU time below",
        f"{gbps(n, e):.2f} GB/s ({ms(e)}; first repeat {ms(s['sync_s'][0])}); CPU {ms(cpu_e)}",
        f"{gbps(n, f):.2f} GB/s ({ms(f)}) [{gbps(n, b):.2f} GB/s ({ms(b)})]; "
        f"CPU {ms(cpu_f)} [{ms(cpu_b)}]",
        f"{ratio:.2f}× (CPU {cpu_f / cpu_e:.2f}×)", "≥ 0.8×",
        yes(ratio >= 0.8, f"received into {'/'.join(into)} buffers, live optimizer state "
            f"copied into {'/'.join(copied)} memory; what is left on the newcomer is one "
            "memcpy of what it received into its live model and optimizer state (it keeps the "
            "snapshot apart as its rollback copy); per-repeat numbers in notes"))
    NOTES.append(f"sync: per-repeat receiver ms {[round(x * 1e3) for x in s['sync_s']]}, raw "
                 f"broadcast ms {[round(x * 1e3) for x in s['bcast_s']]}, raw broadcast into "
                 f"fresh memory ms {[round(x * 1e3) for x in s['bcast_fresh_s']]}; the sender "
                 f"sent from its snapshot (pack() time {ms(pack)}: 0 when nothing was packed); "
                 f"receiver apply() ms "
                 f"{[round(p.get('apply', 0) * 1e3) for p in s['phases']]}, CPU ms "
                 f"{[round(p['cpu'] * 1e3) for p in s['phases']]}, page faults "
                 f"{[p['minflt'] for p in s['phases']]}, received into "
                 f"{[p.get('received_into') for p in s['phases']]}, live state copied into "
                 f"{[p.get('copied_into') for p in s['phases']]}; raw broadcast CPU ms "
                 f"{[round(x * 1e3) for x in s['bcast_cpu_s']]}, into fresh memory "
                 f"{[round(x * 1e3) for x in s['bcast_fresh_cpu_s']]}")
    restore = median([p.get("restore", 0) for p in s["phases"]])
    row(f"sync to a newcomer, {mb(n)}: the newcomer's copy from its snapshot into its live "
        "objects after the receive (restore: load_state_dict into the model, optimizer state "
        "into the arena touched before admission), time within the sync",
        f"{mb(n)} copied in {ms(restore)}", f"the whole sync {ms(e)}",
        f"{restore / e:.0%} of the sync", "no second full copy",
        yes(False, "by design: the snapshot the data lands in is the newcomer's rollback copy "
            "and must stay apart from the live state (sharing them would lose the commit if "
            "every older holder died before the newcomer's next commit); what is left is one "
            "memcpy into memory already touched (no page faults), not a second transfer"))
    moved = r0["sync"]["noop_moved_bytes"] + r1["sync"]["noop_moved_bytes"]
    noop = median([r0["sync"]["noop_sync_s"], r1["sync"]["noop_sync_s"]])
    row("no-change sync (both ranks at the same commit): bytes moved (sync_stats)",
        f"{moved} B, but takes {ms(noop)}", f"— (a commit: {ms(median(r0['sync']['commit_s']))})",
        "—", "0 B", yes(moved == 0))
    NOTES.append(f"no-change sync of {mb(n)}: moves 0 bytes yet takes {ms(noop)}, like a commit "
                 f"({ms(median(r0['sync']['commit_s']))}): every rank re-saves its snapshot after "
                 "any sync (State._after_sync)")
    scan = {int(k): v for k, v in r1["scan"].items()}
    scan0 = {int(k): v for k, v in r0["scan"].items()}
    GROWTH["scan"] = (scan0, scan)
    GROWTH[2] = (r0["growth"], r1["growth"])


@section("sync: striping over 2 holders, and one chain to 3 newcomers")
def bench_sync_wide():
    reps = 3 if QUICK else 5
    res = common.launch(BENCH / "dp_worker.py", 3, ["sync", f"reps={reps}", "holders=2",
                                                     "ks=1:2"], timeout=400)
    s = res[2]["sync"]
    one, two = median(s["by_k"]["1"]), median(s["by_k"]["2"])
    shares = [median(r["sync"]["sent"]["2"]) for r in res[:2]]
    row(f"sync to a newcomer, {mb(s['bytes'])}, 2 holders of the same commit + 1 newcomer "
        "(3 workers): striped, each holder sends half, vs one sender",
        f"{ms(two)} (holders sent {mb(shares[0])} + {mb(shares[1])})", f"{ms(one)}",
        f"{one / two:.2f}×", "report the gain",
        "— on loopback every stream shares the same 2 cores and memory bus; the gain needs "
        "senders whose own link or per-stream copy is the bottleneck (k senders: up to k×, "
        "until the receiver's link is full)")
    NOTES.append("striping: per-repeat newcomer ms, 1 sender "
                 f"{[round(x * 1e3) for x in s['by_k']['1']]}, 2 senders "
                 f"{[round(x * 1e3) for x in s['by_k']['2']]}")
    res = common.launch(BENCH / "dp_worker.py", 4, ["sync", f"reps={reps}", "holders=1"],
                        timeout=400)
    s = res[3]["sync"]
    e, f = median(s["sync_s"]), median(s["bcast_fresh_s"])
    sent = median(res[0]["sync"]["sent"]["8"])
    row(f"sync to 3 newcomers at once, {mb(s['bytes'])}, 1 holder (4 workers): one pipelined "
        "chain, time to the chain's end vs raw gloo broadcast to 3 ranks into fresh memory",
        f"{ms(e)} (the holder sent {mb(sent)}, {sent / s['bytes']:.1f}× the state)", f"{ms(f)}",
        f"{f / e:.2f}×", "one transfer, not n−1", yes(abs(sent / s["bytes"] - 1) < 0.01))


@section("growth at 4 and 8 workers")
def bench_growth():
    for n in (4, 8):
        res = common.launch(BENCH / "dp_worker.py", n, ["growth", "reps=3", "steps=4"],
                            timeout=300)
        GROWTH[n] = (res[0]["growth"], res[-1]["growth"])


def growth_rows():
    sizes = [n for n in (2, 4, 8) if n in GROWTH]
    if sizes:
        g = {n: GROWTH[n] for n in sizes}
        nbytes = g[sizes[0]][0]["bytes"]
        row(f"step time vs world size {'/'.join(map(str, sizes))} (1M MLP, Adam; 4 and 8 are "
            "oversubscribed on 2 cores)",
            " / ".join(ms(median(g[n][0]["step_s"])) for n in sizes), target="no target")
        row(f"commit ({mb(nbytes)}, incl. host-update check) vs world size "
            f"{'/'.join(map(str, sizes))}",
            " / ".join(ms(median(g[n][0]["commit_s"])) for n in sizes), target="no target")
        row(f"sync to one newcomer ({mb(nbytes)}) vs world size {'/'.join(map(str, sizes))}",
            " / ".join(ms(median(g[n][1]["sync_s"])) for n in sizes), target="no target")
    if "scan" in GROWTH:
        scan0, scan = GROWTH["scan"]
        ks = sorted(scan)
        gb = [scan[k]["bytes"] / 1e9 for k in ks]
        for label, src, key in (("commit", scan0, "commit_s"), ("sync to a newcomer", scan,
                                                                "sync_s")):
            ts = [median(src[k][key]) for k in ks]
            slope, icpt = fit(gb, ts)
            row(f"{label} vs model size {'/'.join(f'{k}M' for k in ks)} params "
                f"({'/'.join(mb(scan[k]['bytes']) for k in ks)}, fp32, SGD), 2 workers",
                " / ".join(ms(t) for t in ts),
                "—", f"slope {slope:.2f} s/GB ({1 / slope:.1f} GB/s), intercept {ms(icpt)}",
                "no target")


def fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


# -- 4./5. real elasticrun jobs -------------------------------------------------------------
class Job:
    def __init__(self, args, env=None, hosts=None, prefix=()):
        """``prefix``: an argv prefix for elasticrun (bench-net: ``ip netns exec NS``)."""
        self.dir = Path(tempfile.mkdtemp(prefix="bench-job-"))
        self.out = self.dir / "out"
        self.out.mkdir()
        self.args = list(args)
        if hosts is not None:
            self.hosts_file = self.dir / "hosts.txt"
            self.set_hosts(hosts)
            script = self.dir / "discover.sh"
            script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
            script.chmod(0o755)
            self.args = ["--host-discovery-script", str(script), "--discovery-interval",
                         "0.3"] + self.args
        self.env = common.base_env()
        self.env.update({"BENCH_OUT": str(self.out)}, **(env or {}))
        self.log = open(self.dir / "elasticrun.log", "wb")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "elastic.runner", *self.args, sys.executable,
             str(BENCH / "job_worker.py")], env=self.env, stdout=self.log,
            stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)

    def set_hosts(self, hosts):
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(hosts) + "\n")
        tmp.rename(self.hosts_file)

    def jsonl(self, pattern):
        return common.read_jsonl(self.out, pattern)

    def steps(self):
        return self.jsonl("steps.*.jsonl")

    def events(self):
        return self.jsonl("events.*.jsonl")

    def output(self):
        return (self.dir / "elasticrun.log").read_text(errors="replace")

    def wait_for(self, pred, what, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"job ended before {what}:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.output()[-3000:]}")

    def finish(self, timeout=60):
        (self.out / "stop").write_text("stop")
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = "hung"
        if code != 0:
            raise RuntimeError(f"elasticrun exited {code}:\n{self.output()[-3000:]}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the driver takes its workers along
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


RECOVERY = {}


@section("recovery: elasticrun SIGKILL")
def bench_recovery():
    times, details = [], []
    for _rep in range(2 if QUICK else 3):
        with Job(["-np", "4", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2"],
                 env={"BENCH_KILL": "40:3", "BENCH_STEP_SLEEP": "0.01"}) as job:
            rec, detail = one_recovery(job)
        times.append(rec)
        details.append(detail)
    RECOVERY["elastic"] = times
    NOTES.append("recovery (elastic), per repeat: " + "; ".join(details))


def one_recovery(job):
    job.wait_for(lambda: (job.out / "kill.json").exists(), "the kill")
    kill = json.loads((job.out / "kill.json").read_text())
    kill_round = kill["round"]

    def survivors_stepped():
        after = [r for r in job.steps() if r["round"] > kill_round]
        return len({r["rank"] for r in after}) >= 2 and max(r["step"] for r in after) > \
            min(r["step"] for r in after) + 5
    job.wait_for(survivors_stepped, "survivors' steps after the kill")
    job.finish()
    after = [r for r in job.steps() if r["round"] > kill_round]
    firsts = {}
    for r in after:
        firsts[r["rank"]] = min(firsts.get(r["rank"], r["t"]), r["t"])
    rec = max(firsts.values()) - kill["t"]
    joined = [e["t"] for e in job.events() if e["what"] == "joined" and e["t"] > kill["t"]]
    return rec, (f"kill→rejoined {min(joined) - kill['t']:.2f} s, →next step {rec:.2f} s"
                 if joined else f"{rec:.2f} s")


@section("recovery: restart baseline")
def bench_restart():
    import torch
    tmp = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    torch.manual_seed(0)
    model = common.tiny_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = common.batch_for("tiny", 32, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    ckpt = tmp / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 40}, ckpt)
    times, parts = [], []
    for rep in range(2 if QUICK else 3):
        n = 2  # the survivors' count: what a restart-based launcher brings back
        old = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
               for _ in range(n)]
        time.sleep(0.3)
        out = tmp / f"rep{rep}"
        out.mkdir()
        env = common.base_env()
        env.update({"BENCH_OUT": str(out), "BENCH_CKPT": str(ckpt), "WORLD_SIZE": str(n),
                    "MASTER_PORT": str(common.free_port()), "BENCH_STEP_SLEEP": "0.01"})
        t0 = time.time()
        for p in old:
            p.kill()
        for p in old:
            p.wait()
        new = [subprocess.Popen([sys.executable, str(BENCH / "restart_worker.py")],
                                env={**env, "RANK": str(r)}, cwd=str(REPO)) for r in range(n)]
        for p in new:
            if p.wait(120) != 0:
                raise RuntimeError("restart worker failed")
        recs = [json.loads((out / f"restart.{r}.json").read_text()) for r in range(n)]
        times.append(max(r["t_step"] for r in recs) - t0)
        parts.append("import {:.2f} s, rendezvous {:.2f} s, load {:.2f} s, step {:.2f} s".format(
            max(r["t_imported"] for r in recs) - t0,
            max(r["t_rdzv"] for r in recs) - max(r["t_imported"] for r in recs),
            max(r["t_loaded"] - r["t_rdzv"] for r in recs),
            max(r["t_step"] - r["t_loaded"] for r in recs)))
    RECOVERY["restart"] = times
    shutil.rmtree(tmp, ignore_errors=True)
    NOTES.append("recovery (restart baseline, 2 fresh processes): per repeat "
                 + ", ".join(f"{t:.2f} s" for t in times) + "; last: " + parts[-1])


def recovery_rows():
    e, b = median(RECOVERY.get("elastic", [])), median(RECOVERY.get("restart", []))
    if e is not None:
        row("recovery: SIGKILL 1 of 4 workers (elasticrun -H localhost:2,127.0.0.1:2 --min-np 2)"
            " → both survivors completed their next step", secs(e), "—", "—", "≤ 0.2 s",
            yes(e <= 0.2))
    if e is not None and b is not None:
        row("recovery vs restart-based (torchrun-style: kill all, start 2 processes, import "
            "torch, init_process_group on a fresh TCPStore, torch.load state, first step)",
            secs(e), secs(b), f"{b / e:.1f}× faster", "≥ 5× faster", yes(b / e >= 5))


@section("scale-up: elasticrun discovery adds a host")
def bench_scaleup():
    with Job(["-np", "2", "--min-np", "2"], hosts=["localhost:2"],
             env={"BENCH_STEP_SLEEP": "0.01"}) as job:
        scaleup(job)


def scaleup(job):
    job.wait_for(lambda: any(r["step"] >= 30 for r in job.steps()), "step 30")
    t_add = time.time()
    job.set_hosts(["localhost:2", "127.0.0.1:2"])
    job.wait_for(lambda: len([r for r in job.steps() if r["size"] == 4]) >= 4 * 20,
                 "20 steps at 4 workers", timeout=180)
    job.finish()
    steps, events = job.steps(), job.events()
    starts = {p.name.split(".", 1)[1]: json.loads(p.read_text()) for p in job.out.glob("start.*")}
    first_round = min(r["round"] for r in steps)
    old_wids = {p.name.split(".")[1] for p in job.out.glob("steps.*.jsonl")
                if any(json.loads(x)["round"] == first_round
                       for x in p.read_text().splitlines() if x.strip())}
    new_wids = set(starts) - old_wids
    t_spawn = min(starts[w]["t_start"] for w in new_wids)
    t_imported = max(starts[w]["t_imported"] for w in new_wids)
    t_ready = max(e["t"] for e in events if e["what"] == "ready_to_join" and e["wid"] in new_wids)
    t_int = min(e["t"] for e in events if e["what"] == "interrupt")
    r0 = [r for r in steps if r["rank"] == 0 and r["round"] == first_round]
    window = [r for r in r0 if t_spawn <= r["t"] <= t_int]
    row("scale-up 2→4 workers (discovery adds 127.0.0.1:2): steps the survivors completed "
        "while the newcomers started (spawn → admission)",
        f"{len(window)} steps in {t_int - t_spawn:.2f} s", "—", "—",
        "> 0", yes(len(window) > 0))
    new_round = min(r["round"] for r in steps if r["size"] == 4)
    surv = []
    for rank in (0, 1):
        before = max(r["t"] for r in steps if r["round"] == first_round and r["rank"] == rank)
        after = min(r["t"] for r in steps if r["round"] == new_round and r["rank"] == rank)
        surv.append((before, after))
    gap = max(a - b for b, a in surv)
    sync_start = [e["t"] for e in events if e["what"] == "sync_start" and e["round"] == new_round]
    sync_end = [e["t"] for e in events if e["what"] == "sync_end" and e["round"] == new_round]
    moved = sum(e.get("received", 0) for e in events
                if e["what"] == "sync_end" and e["round"] == new_round)
    transfer = max(sync_end) - max(sync_start)
    admission = gap - transfer
    steady = median([b["t"] - a["t"] for a, b in zip(r0, r0[1:])][-20:])
    row("scale-up: survivors' pause at admission (gap between their steps around the round "
        "change) = admission + state transfer",
        f"{secs(gap)} = {secs(admission)} + {ms(transfer)} ({mb(moved)})",
        f"normal step {ms(steady)}", "—", "pause ≤ 0.1 s",
        yes(gap <= 0.1))
    NOTES.append(f"scale-up: hosts file changed at +0, newcomers' python started at "
                 f"+{t_spawn - t_add:.2f} s, imported torch by +{t_imported - t_add:.2f} s, "
                 f"ready to join at +{t_ready - t_add:.2f} s, survivors interrupted at "
                 f"+{t_int - t_add:.2f} s; {len(window)} survivor steps in between")


# -- 7. durable checkpoints ----------------------------------------------------------------
@section("checkpoint")
def bench_ckpt():
    parent = os.environ.get("BENCH_CKPT_DIR") or None
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-", dir=parent)
    try:
        r = common.run_script(BENCH / "ckpt_bench.py", [tmp, "5" if QUICK else "7"], timeout=180)
        df = subprocess.run(["df", "-P", tmp], capture_output=True, text=True).stdout.split()
        disk = f"{df[-6]} mounted on {df[-1]}" if len(df) >= 7 else "?"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    what = f"{r['params'] / 1e6:.1f}M-param MLP + Adam, {mb(r['state_bytes'])}"

    # (1) write throughput: the writer thread alone vs dd of as many bytes, same directory.
    # The checkpoint is durable and visible when write_checkpoint returns; the prune of the
    # oldest one that follows frees blocks (as dd's O_TRUNC does, before dd's own clock
    # starts) and is shown beside it.
    w = [b / s / 1e9 for b, s in zip(r["write_bytes"], r["write_inner_s"])]
    d = [b / s / 1e9 for b, s in zip(r["dd_bytes"], r["dd_s"])]
    wg, dg = median(w), median(d)
    ratio = wg / dg
    pairs = [a / b for a, b in zip(w, d)]
    hash_gbs = r["state_bytes"] / median(r["hash_s"]) / 1e9
    sha_gbs = r["state_bytes"] / median(r["sha_s"]) / 1e9
    row(f"checkpoint write throughput, {what}, every tensor changed (xxh3-128 content hash, "
        "write, fsync, rename, manifest: durable and visible; training thread idle) vs dd "
        "if=/dev/zero bs=4M conv=fsync of as many bytes to the same directory (dd's own time); "
        "the prune of the oldest checkpoint that follows, and the wait for both, in brackets",
        f"{wg:.2f} GB/s ({ms(median(r['write_inner_s']))}) [prune {ms(median(r['prune_s']))}"
        f", wait {ms(median(r['write_s']))}]",
        f"{dg:.2f} GB/s ({ms(median(r['dd_s']))}) [wall {ms(median(r['dd_wall_s']))}]",
        f"{ratio:.2f}× (paired {min(pairs):.2f}–{max(pairs):.2f})", "≥ 0.8×",
        yes(ratio >= 0.8, f"the content hash alone runs at {hash_gbs:.1f} GB/s here (sha256: "
            f"{sha_gbs:.2f} GB/s); what is left is the per-blob write + fsync against dd's one "
            "stream and one fsync, on 2 cores shared with the rest of the machine; per-repeat "
            "ratios in notes"))
    NOTES.append(f"checkpoint write, per repeat (interleaved with dd, order alternating): "
                 f"ratio {[round(x, 2) for x in pairs]}; "
                 f"write_checkpoint {[round(x * 1e3) for x in r['write_inner_s']]} ms (of "
                 f"which until every byte was hashed and written, before the renames and the "
                 f"manifest {[round(x * 1e3) for x in r['write_release_s']]}), prune after it "
                 f"{[round(x * 1e3) for x in r['prune_s']]} ms, Checkpointer.wait() "
                 f"{[round(x * 1e3) for x in r['write_s']]} ms, "
                 f"{mb(median(r['write_bytes']))} each; dd {[round(x * 1e3) for x in r['dd_s']]}"
                 f" ms as dd reports it (wall incl. process start and its O_TRUNC "
                 f"{[round(x * 1e3) for x in r['dd_wall_s']]}), {mb(r['dd_bytes'][0])}; "
                 f"warm-up (writer wait, dd) before these, unused: "
                 f"{[(round(a * 1e3), round(b * 1e3)) for a, b in r.get('warm', [])]} ms; "
                 f"xxh3-128 of the same bytes alone {[round(x * 1e3) for x in r['hash_s']]} ms, "
                 f"sha256 {[round(x * 1e3) for x in r['sha_s']]} ms; "
                 f"disk {disk}; first (all-new) checkpoint {ms(r['first']['seconds'])}")

    # (2) stall: commit with a checkpoint due (writer idle) vs a commit without a checkpointer
    commit = median(r["plain_s"])
    diffs = [a - b for a, b in zip(r["due_s"], r["plain_s"])]
    direct = median(diffs)
    handoff = median(r["handoff_s"])
    swap = median(r["swap_s"]) or 0.0
    stall = handoff + swap
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    cpu = median([a - b for a, b in zip(r["due_cpu"], r["plain_cpu"])])
    cpu_commit = median(r["plain_cpu"])
    row(f"training stall per checkpoint ({what}): hand-off in the commit that starts it + "
        "spare-buffer swap in the next commit if the writer still reads; "
        "direct: commit with a checkpoint due − commit without a checkpointer",
        f"{us(stall)} = {us(handoff)} + {us(swap)}; direct: wall {direct * 1e3:+.1f} ms "
        f"(IQR {q1 * 1e3:+.1f}…{q3 * 1e3:+.1f}), training thread's CPU {cpu * 1e3:+.2f} ms",
        f"commit without checkpointer {ms(commit)}",
        f"{100 * stall / commit:.1f}% of a commit (direct: wall {100 * direct / commit:+.0f}%"
        f", CPU {100 * cpu / cpu_commit:+.0f}%)",
        "≤ 10%", yes(stall / commit <= 0.10) + (
            f" by the hand-off; but the direct difference is {100 * direct / commit:+.0f}% "
            f"(wall, IQR {100 * q1 / commit:+.0f}%…{100 * q3 / commit:+.0f}%) / "
            f"{100 * cpu / cpu_commit:+.0f}% (CPU) in this run: per-pair values in notes"
            if max(direct / commit, cpu / cpu_commit) > 0.1 else ""))
    nxt = median(r["next_s"])
    st, stw = median(r["step_s"]), median(r["step_write_s"])
    row("training while a checkpoint is being written (writer thread hashing and writing, "
        "2 shared cores): training step / next commit vs the same without a write running",
        f"{ms(stw)} / {ms(nxt)}", f"{ms(st)} / {ms(commit)}",
        f"{stw / st:.2f}× / {nxt / commit:.2f}×", "no target")
    NOTES.append(f"checkpoint stall, per repeat ms: commit with a checkpoint due "
                 f"{[round(x * 1e3, 1) for x in r['due_s']]}, commit without checkpointer "
                 f"{[round(x * 1e3, 1) for x in r['plain_s']]} (back to back, order alternating"
                 f"; their training-thread CPU ms {[round(x * 1e3, 1) for x in r['due_cpu']]} vs "
                 f"{[round(x * 1e3, 1) for x in r['plain_cpu']]}); hand-off µs "
                 f"{[round(x * 1e6) for x in r['handoff_s']]} (the ms outliers "
                 "are likely the GIL: the writer thread starts with pure-Python work, and the "
                 "switch interval is 5 ms); swap µs "
                 f"{[round(x * 1e6) for x in r['swap_s']]} ({r['swapped_commits']} commits "
                 f"found the writer still reading); next commit while writing "
                 f"{[None if x is None else round(x * 1e3, 1) for x in r['next_s']]}; "
                 f"step while writing {[None if x is None else round(x * 1e3) for x in r['step_write_s']]}")

    # (3) bytes written per checkpoint: half the parameters frozen vs nothing frozen
    half = median(r["half_written"][1:])
    full = median(r["write_bytes"])
    ratio = half / full
    row(f"bytes written per checkpoint (after the first), {what}: half the parameters frozen "
        "(incremental: unchanged blobs are not rewritten) vs nothing frozen (every tensor "
        "changes: a full checkpoint)", mb(half), mb(full), f"{ratio:.2f}×", "≈ 0.5×",
        yes(abs(ratio - 0.5) <= 0.05))
    NOTES.append(f"checkpoint bytes: with half the parameters frozen the state is "
                 f"{mb(r['half_total'])} (frozen weights {mb(r['frozen_bytes'])}, no Adam state "
                 f"for them); checkpoints write {[mb(x) for x in r['half_written']]} (first = "
                 f"all); so vs a full (non-incremental) checkpoint of that same state the "
                 f"incremental one writes {half / r['half_total']:.2f}×: everything except "
                 f"the frozen weights ({mb(r['half_total'] - r['frozen_bytes'])} + small-tensor "
                 f"pack and skeleton {(half - r['half_total'] + r['frozen_bytes']) / 1e3:.0f} kB)")


# -- output -------------------------------------------------------------------------------
# -- elastic.torch ops -------------------------------------------------------------------
@section("ops")
def bench_ops():
    r0 = common.launch(BENCH / "ops_bench.py", 2, [3 if QUICK else 7])[0]
    for label in ("4 KB", "4 MB"):
        c, p = median(r0[label]["checked"]), median(r0[label]["plain"])
        row(f"hvd.allreduce {label} float32, 2 workers: latency with the pre-op check vs "
            "elastic.allreduce (no check)", us(c), us(p), f"{c / p:.2f}×")
    g, loose = median(r0["grouped"]["grouped"]), median(r0["grouped"]["loose"])
    row("hvd.grouped_allreduce of 50 × 1 KB vs 50 hvd.allreduce calls (one check for the group)",
        ms(g), ms(loose), f"{g / loose:.2f}×", "—", "—")
    NOTES.append("ops: medians of per-call times, the two sides alternating call by call "
                 "(robust to this shared machine's load spikes); the check is one allgather "
                 "of 29 int64 per op (per group)")


# -- AdaScale ------------------------------------------------------------------------------
@section("adascale")
def bench_adascale():
    reps = 10 if QUICK else 40
    r0 = common.launch(BENCH / "adascale_bench.py", 2, [reps, "mlp:cnn"], timeout=600)[0]
    for kind, label in (("mlp", "MLP"), ("cnn", "small CNN")):
        d = r0[kind]
        pairs = [a / b for a, b in zip(d["adascale"], d["linear"])]   # back to back
        ratio = median(pairs)
        q1, _, q3 = statistics.quantiles(pairs, n=4)
        row(f"LRScaler rule=adascale vs linear, {label} {d['params'] / 1e6:.2f}M params, "
            "2 workers, batch 16: step time", ms(median(d["adascale"])),
            ms(median(d["linear"])), f"{ratio:.3f}× (IQR {q1:.3f}–{q3:.3f})", "≤ 1.02×",
            yes(ratio <= 1.02, f"within this shared machine's noise: the paired ratios' "
                f"IQR reaches {q1:.3f}" if q1 <= 1.02 else "see notes"))
        for key, every in (("", "every step"), ("8", "every 8th step")):
            spent, steps = sum(d["observer" + key]), sum(d["cpu_adascale" + key])
            row(f"adascale's own work (two norms per bucket, issuing the scalar allreduce), "
                f"measuring {every}, {label}: CPU time of the training thread, share of its "
                f"CPU per step", f"{us(spent / len(d['observer' + key]))} per step",
                f"{ms(steps / len(d['cpu_adascale' + key]))} per step", f"{spent / steps * 100:.2f} %",
                "≤ 2 %", yes(spent / steps <= 0.02))
    NOTES.append(f"adascale: {reps} steps per side, the sides (linear, adascale, adascale "
                 "measure_every=8) taking turns step by step "
                 "(which goes first rotates); ratio = median of the back-to-back pairs; "
                 "its extra work: two squared norms per gradient bucket and one allreduce of "
                 "one float64, queued behind the last bucket")


# -- FSDP2 sharded state -------------------------------------------------------------------
@section("fsdp")
def bench_fsdp():
    reps = 6 if QUICK else 20
    rs = common.launch(BENCH / "fsdp_bench.py", 4, [reps], timeout=600)
    full = rs[0]["full"]
    worst = max(r["live"] + r["held"] for r in rs)
    target = 0.75 * 1.1
    row("ShardedState, FSDP2 MLP + AdamW, 4 workers, redundancy 1: bytes of training state "
        "per rank (live shard + commit + one copy), worst rank, vs the full state "
        f"({mb(full)})", mb(worst), f"{mb(2 * full)} (a replica: live + commit)",
        f"{worst / full:.2f}× of the full state", "≤ 0.83× (3/4 + 10 %)",
        yes(worst / full <= target))
    with_copy = median([t for r in rs for t in r["commit"]["1"]])
    without = median([t for r in rs for t in r["commit"]["0"]])
    row("ShardedState commit, 4 workers: redundancy 1 vs 0 (copies sent to a neighbour)",
        ms(with_copy), ms(without), f"{with_copy / without:.2f}×", "report", "—")
    moved = max(r["reshard_received"] for r in rs)
    bw = rs[1]["bandwidth"]
    took = median([max(ts) for ts in zip(*(r["reshard"] for r in rs))])
    ideal = moved / bw
    row(f"reshard 3 → 4 workers (a newcomer), redundancy 1: time until every rank holds its "
        f"new shard vs most bytes one rank received ({mb(moved)}) / link bandwidth measured "
        f"by gloo send/recv, taking turns ({bw / 1e9:.2f} GB/s)",
        ms(took), ms(ideal), f"{took / ideal:.2f}×", "≤ 1.5×", yes(took / ideal <= 1.5))
    bare = median([max(ts) for ts in zip(*(r["reshard_bare"] for r in rs))])
    total = sum(r["reshard_bare_received"] for r in rs)
    busiest = max(r["reshard_bare_received"] + r["reshard_bare_sent"] for r in rs)
    NOTES.append(f"fsdp reshard 3 → 4: with redundancy 1 the survivors' copies already hold "
                 f"their new rows, so only the newcomer's {mb(moved)} move (from its shard's "
                 f"two holders). Without copies (redundancy 0): {ms(bare)} "
                 f"({bare / ideal:.2f}× of the ideal above), {mb(total)} moved in all, the "
                 f"busiest rank sent and received {mb(busiest)}; 4 processes share the cores")
    NOTES.append("fsdp: reshard rows move the committed layout of the model above between "
                 "live ranks of one round (no membership change in the bench); steady "
                 "throughput against torchrun is section fsdpsteady")


def add_rows(got, notes):
    """A bench module's rows and notes (its ``rows()``), into this run's table."""
    for r in got:
        row(*r)
    NOTES.extend(notes)


@section("fsdpsteady")
def bench_fsdp_steady():
    import fsdp_steady
    add_rows(*fsdp_steady.rows(quick=QUICK))


@section("fsdpckpt")
def bench_fsdp_ckpt():
    import fsdp_ckpt_bench
    add_rows(*fsdp_ckpt_bench.rows(quick=QUICK))


@section("driver restart: joining mode")
def bench_driver_restart():
    import driver_restart_bench
    lost, steps, details = [], [], []
    for _rep in range(1 if QUICK else 2):
        one, step, detail = driver_restart_bench.run_once()
        lost.append(one)
        steps.append(step)
        details.append(detail)
    e, b = median(lost), median(steps)
    row("driver restart (elasticrun --serve SIGKILLed, the same command run again; 2 agents): "
        "training time lost (no step completing) from the kill to the adopted round's first "
        "step, the restart excluded (workers train on meanwhile) vs one steady step",
        secs(e), ms(b), f"{e / b:.0f} steps", "≤ 2 s", yes(e <= 2.0))
    NOTES.append("driver restart, per repeat: " + "; ".join(details))


def table():
    head = ["metric", "elastic", "baseline", "ratio", "target", "met?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ROWS:
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")
    return "\n".join(lines)


@section("ddp")
def bench_ddp():
    import ddp_bench
    add_rows(*ddp_bench.rows(quick=QUICK))


@section("sync pause: the survivors' span, 120 MB to one newcomer")
def bench_sync_pause():
    import sync_pause_bench
    add_rows(*sync_pause_bench.rows(Job, quick=QUICK))


@section("goodput under churn: a random worker SIGKILLed every 10 s")
def bench_churn():
    import churn_bench
    add_rows(*churn_bench.rows(Job, quick=QUICK))


@section("goodput under churn: mixed faults every 10 s")
def bench_churn_mixed():
    import churn_bench
    add_rows(*churn_bench.rows(Job, quick=QUICK, mixed=True))


@section("a newcomer's set-up beside training")
def bench_spawn():
    import spawn_bench
    add_rows(*spawn_bench.rows(quick=QUICK))


def main():
    import torch
    only = set(filter(None, os.environ.get("BENCH_ONLY", "").split(",")))
    for name, fn in (("steady", bench_steady), ("commit", bench_commit), ("sync", bench_sync),
                     ("syncwide", bench_sync_wide),
                     ("recovery", bench_recovery), ("restart", bench_restart),
                     ("scaleup", bench_scaleup), ("growth", bench_growth),
                     ("ops", bench_ops), ("ckpt", bench_ckpt), ("adascale", bench_adascale),
                     ("ddp", bench_ddp), ("fsdp", bench_fsdp),
                     ("fsdpsteady", bench_fsdp_steady), ("fsdpckpt", bench_fsdp_ckpt),
                     ("driverrestart", bench_driver_restart), ("syncpause", bench_sync_pause),
                     ("churn", bench_churn),
                     ("churnmix", bench_churn_mixed), ("spawn", bench_spawn)):
        if not only or name in only:
            fn()
    recovery_rows()
    growth_rows()
    total = time.monotonic() - T0
    header = (f"2 gloo workers on loopback unless a row says otherwise, OMP_NUM_THREADS=1, "
              f"torch {torch.__version__}, {os.cpu_count()} CPU cores (shared). Medians of "
              f"repeats measured in the same run; total runtime {total:.0f} s.")
    text = table()
    notes = "\n".join(f"- {n}" for n in NOTES)
    print(f"\n{header}\n\n{text}\n\nNotes:\n{notes}\n")
    # A subset run keeps the full table: it writes next to it (not committed).
    out = BENCH / ("results.md" if not only else "results-partial.md")
    what = "`make bench`" if not only else f"`BENCH_ONLY={','.join(sorted(only))} make bench`"
    out.write_text(f"# {what} results\n\n{header}\n\n{text}\n\nNotes:\n\n{notes}\n")


if __name__ == "__main__":
    main()
