"""Train one small synthetic model three ways and plot the loss curves.

    python examples/three_modes.py --out three_modes.png

1. fixed:        4 workers from start to end (the reference).
2. lr-scaling:   per-worker batch fixed, world 4 -> 2 -> 3, lr scaled linearly
                 with the world (elastic.LRScaler, base size 4).
3. global-batch: constant global batch G = 4 x per-worker batch, world 4 -> 2 -> 3
                 (ElasticSampler(global_batch_size=G)); lr fixed.

Each run is a real elasticrun job on this machine: localhost, 127.0.0.1 and this
machine's hostname play three hosts, listed by a discovery file that the script
edits at known steps (the workers hold there until the round changes). The plot
shows the loss on the whole data set after every step, with the membership
changes marked. The global-batch curve lies on the fixed one: same samples per
step, same gradients. The lr-scaling curve departs from it at the first change.

Needs matplotlib (pip install matplotlib). The same file is the worker script
(run by elasticrun with --worker).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BASE_SIZE = 4
SCHEDULE = [(0, 4), (20, 2), (40, 3)]   # (after step, world size)


# ------------------------------------------------------------------------- worker side

def worker(args):
    import torch

    import elastic

    elastic.init()
    wid = os.environ.get("ELASTIC_WORKER_ID", "solo")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=gen, dtype=torch.float64)
    w_true = torch.randn(16, 1, generator=gen, dtype=torch.float64)
    y = torch.tanh(x @ w_true) + 0.1 * torch.randn(args.samples, 1, generator=gen,
                                                   dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1)).double()
    optimizer = elastic.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters())
    dataset = torch.utils.data.TensorDataset(x, y)
    global_batch = args.batch * BASE_SIZE
    if args.mode == "global-batch":
        sampler = elastic.ElasticSampler(dataset, seed=1, global_batch_size=global_batch)
    else:
        sampler = elastic.ElasticSampler(dataset, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)
    if args.mode == "lr-scaling":
        state.register_reset_callbacks([elastic.LRScaler(optimizer, base_size=BASE_SIZE,
                                                         rule="linear")])
    holds = {after for after, _ in SCHEDULE[1:]} if args.mode != "fixed" else set()
    log = open(os.path.join(args.run_dir, f"loss.{wid}.jsonl"), "a", buffering=1)
    mse = torch.nn.functional.mse_loss

    def finish_step(samples):
        state.step += 1
        if elastic.rank() == 0:
            with torch.no_grad():
                loss = mse(model(x), y).item()
            log.write(json.dumps({"step": state.step, "size": elastic.size(), "loss": loss,
                                  "samples": samples}) + "\n")
        if state.step in holds:   # wait here (committing) until the new round starts
            while True:
                state.commit()
                go = os.path.exists(os.path.join(args.run_dir, f"go.{state.step}"))
                if int(elastic.broadcast(torch.tensor([int(go)]), 0)):
                    break
                time.sleep(0.05)
        else:
            state.commit()

    def ordinary_epoch():
        for batch_idx, (xb, yb) in enumerate(loader):   # per-worker batch of args.batch
            optimizer.zero_grad()
            mse(model(xb), yb).backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, args.batch)
            finish_step(args.batch * elastic.size())
            if state.step >= args.steps:
                return False
        return True

    def global_batch_epoch():
        for batch in state.sampler.global_batches(optimizer):
            optimizer.zero_grad()
            for micro in batch:                   # this worker's share of the G samples
                micro.backward(mse(model(x[micro.indices]), y[micro.indices]))
            optimizer.step()                      # the mean gradient over all G samples
            state.sampler.record_global_batch()
            finish_step(batch.size)
            if state.step >= args.steps:
                return False
        return True

    @elastic.run
    def train(state):
        while state.step < args.steps:
            state.sampler.set_epoch(state.epoch)
            done = global_batch_epoch() if args.mode == "global-batch" else ordinary_epoch()
            if not done:
                break
            state.epoch += 1
            state.commit()

    train(state)


# ------------------------------------------------------------------------- driver side

def read_log(run_dir):
    by_step = {}
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("loss.") and name.endswith(".jsonl"):
            with open(os.path.join(run_dir, name)) as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def run_job(mode, args, workdir):
    run_dir = os.path.join(workdir, mode)
    os.makedirs(run_dir)
    hosts_file = os.path.join(run_dir, "hosts")
    third = socket.gethostname()
    host_lists = {4: ["localhost:2", "127.0.0.1:2"], 2: ["127.0.0.1:2"],
                  3: ["127.0.0.1:2", f"{third}:1"]}

    def set_hosts(size):
        with open(hosts_file + ".tmp", "w") as f:
            f.write("\n".join(host_lists[size]) + "\n")
        os.replace(hosts_file + ".tmp", hosts_file)

    set_hosts(4)
    discover = os.path.join(run_dir, "discover.sh")
    with open(discover, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(discover, 0o755)
    if mode == "fixed":
        hosts = ["-H", "localhost:2,127.0.0.1:2"]
    else:
        hosts = ["--min-np", "2", "--max-np", "4", "--host-discovery-script", discover,
                 "--discovery-interval", "0.3"]
    cmd = [sys.executable, "-m", "elastic.runner", "-np", "4", *hosts,
           sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode,
           "--run-dir", run_dir, "--steps", str(args.steps), "--batch", str(args.batch),
           "--lr", str(args.lr), "--samples", str(args.samples)]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    began = time.monotonic()
    with open(os.path.join(run_dir, "elasticrun.log"), "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        if mode != "fixed":
            for after, size in SCHEDULE[1:]:
                wait_for(proc, run_dir, lambda log, after=after: any(r["step"] >= after for r in log))
                set_hosts(size)
                if not wait_for(proc, run_dir, lambda log, after=after, size=size: any(
                        r["step"] > after and r["size"] == size for r in log), timeout=120):
                    open(os.path.join(run_dir, f"go.{after}"), "w").close()   # never hang
        code = proc.wait(timeout=600)
    elapsed = time.monotonic() - began
    if code != 0:
        with open(os.path.join(run_dir, "elasticrun.log"), errors="replace") as f:
            sys.stderr.write(f.read()[-3000:])
        raise SystemExit(f"three_modes: the {mode} job failed (exit {code})")
    return read_log(run_dir), elapsed


def wait_for(proc, run_dir, predicate, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate(read_log(run_dir)):
            return True
        if proc.poll() is not None:
            return predicate(read_log(run_dir))
        time.sleep(0.1)
    return False


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"fixed": dict(color="black", lw=3.0, alpha=0.35),
              "lr-scaling": dict(color="tab:orange", lw=1.6),
              "global-batch": dict(color="tab:blue", lw=1.4, ls="--")}
    fig, (ax, ax_size) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    for mode, (log, _) in results.items():
        steps = [r["step"] for r in log]
        ax.plot(steps, [r["loss"] for r in log], label=mode, **styles[mode])
        ax_size.step(steps, [r["size"] for r in log], where="mid", label=mode,
                     **styles[mode])
    for after, size in SCHEDULE[1:]:
        for a in (ax, ax_size):
            a.axvline(after + 0.5, color="grey", ls=":", lw=1)
        before = [z for s, z in SCHEDULE if s < after][-1]
        ax.annotate(f"{before} -> {size} workers", xy=(after + 0.5, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(4, -14),
                    textcoords="offset points", fontsize=9, color="dimgrey")
    ax.set_yscale("log")
    ax.set_ylabel("loss on the whole data set")
    ax.set_title("fixed 4 workers vs elastic 4 -> 2 -> 3 (lr scaling / constant global batch)")
    ax.legend()
    ax_size.set_ylabel("workers")
    ax_size.set_xlabel("optimizer step")
    ax_size.set_yticks([2, 3, 4])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def driver(args):
    workdir = tempfile.mkdtemp(prefix="elastic-three-modes-")
    results = {}
    for mode in ("fixed", "lr-scaling", "global-batch"):
        log, elapsed = run_job(mode, args, workdir)
        results[mode] = (log, elapsed)
        sizes = []
        for r in log:
            if not sizes or sizes[-1] != r["size"]:
                sizes.append(r["size"])
        print(f"{mode:>12}: {len(log)} steps in {elapsed:5.1f} s, workers "
              f"{' -> '.join(map(str, sizes))}, final loss {log[-1]['loss']:.6f}", flush=True)
    fixed = results["fixed"][0]
    for mode in ("lr-scaling", "global-batch"):
        log = results[mode][0]
        diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(log, fixed))
        print(f"{mode:>12}: largest relative loss difference from fixed over all steps "
              f"{diff:.2e}", flush=True)
    plot(results, args.out)
    print(f"wrote {args.out} (job logs in {workdir})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="three_modes.png", help="where to save the PNG")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8, help="per-worker batch at 4 workers")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
