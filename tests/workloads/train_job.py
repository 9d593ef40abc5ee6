"""Deterministic elastic training job used by the integration tests.

Everything a test asserts comes from files in $JOB_OUT:
  steps.<worker>.jsonl  one line per step: epoch, step, rank, size, host, round
  final.<rank>.json     digests of parameters and optimizer state at the end
  history.json          rank 0's committed history: (epoch, step, sample ids)
Holds: with JOB_HOLD="6,12" every rank stops at those steps and keeps
committing until the test creates $JOB_OUT/go.<step>, so a test can change
membership at a known point without racing the training.
Faults: JOB_FAULT="step:rank:mode;..." (mode exit|raise|kill|stop|stuck), each fires once;
stuck blocks the training thread for good while the heartbeat thread lives on;
JOB_RESET_FAULT=R makes rank R fail once inside a reset callback.
Network and user faults: JOB_BAD_IFACE_HOST=H gives the workers on host H a gloo
interface that does not exist (GLOO_SOCKET_IFNAME=bogus0), as a firewall that opens only
the store port would; JOB_BAD_ROOT=S makes every rank broadcast from a root rank that
does not exist at step S and after (a user bug inside a collective); JOB_ALWAYS_RAISE=S:R
makes whichever worker runs rank R raise at step S, every time; JOB_RANK0_PHASE=S:SECONDS
makes rank 0 busy alone for SECONDS once step S is committed, every time (a
rank-0-only evaluation); JOB_SLOW_HOST=H:SECONDS makes the workers on host H spend
SECONDS more on every step (a straggler).
Gate: JOB_GATE=S makes every rank wait at step S, before its commit and without any
collective, until $JOB_OUT/gate exists. JOB_SYNC_GATE=H makes the first worker on host H
that receives the state in a sync stop inside it (after the state's header came, before
its tensors): it writes $JOB_OUT/syncing.<worker> and waits for $JOB_OUT/sync-go.
End gate: with JOB_END_GATE set, every worker waits after its final line, before it exits,
until $JOB_OUT/end-go exists (a driver killed after training ended, before any exit).
Soak hooks: a file $JOB_OUT/stuck.<worker> blocks that worker's training thread for
good; with JOB_END_FILE, the job ends after the epoch during which that file appeared
(rank 0 decides, so every rank agrees).
"""

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch
from job_helpers import digest, hold, job_device, optimizer_tensors

import elastic

OUT = os.environ["JOB_OUT"]
EPOCHS = int(os.environ.get("JOB_EPOCHS", "3"))
BATCH = int(os.environ.get("JOB_BATCH", "4"))
SAMPLES = int(os.environ.get("JOB_SAMPLES", "48"))
COMMIT_EVERY = int(os.environ.get("JOB_COMMIT_EVERY", "1"))
HOLDS = {int(s) for s in os.environ.get("JOB_HOLD", "").split(",") if s}
FAULT = os.environ.get("JOB_FAULT", "")
WID = os.environ.get("ELASTIC_WORKER_ID", "solo")
GATE = int(os.environ.get("JOB_GATE", "0"))
END_FILE = os.environ.get("JOB_END_FILE")
BAD_ROOT = int(os.environ.get("JOB_BAD_ROOT", "0"))
SYNC_GATE = os.environ.get("JOB_SYNC_GATE")


def _pair(name):
    """JOB_X=A:B as (int A, float B), or None."""
    value = os.environ.get(name)
    return (int(value.split(":")[0]), float(value.split(":")[1])) if value else None


ALWAYS_RAISE = _pair("JOB_ALWAYS_RAISE")
RANK0_PHASE = _pair("JOB_RANK0_PHASE")
SLOW = os.environ.get("JOB_SLOW_HOST", "").split(":")


class SyncGate:
    """Part of the state (JOB_SYNC_GATE): rebuilt by ``sync_gate`` wherever it is unpickled."""

    def __reduce__(self):
        return (sync_gate, ())


def sync_gate():
    """On JOB_SYNC_GATE's host, once, when unpickled from a received sync header: wait."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_name != "receive_buffers":
        frame = frame.f_back
    marker = os.path.join(OUT, f"syncing.{WID}")
    if frame is not None and SYNC_GATE == os.environ.get("ELASTIC_HOSTNAME") and \
            not os.path.exists(marker):
        open(marker, "w").close()
        while not os.path.exists(os.path.join(OUT, "sync-go")):
            time.sleep(0.05)
    return SyncGate()


def maybe_fault(step):
    """Fire each fault of JOB_FAULT once per job (rank '*' fires on every rank)."""
    for index, spec in enumerate(f for f in FAULT.split(";") if f):
        at, rank, mode = spec.split(":")
        if int(at) != step or (rank != "*" and int(rank) != elastic.rank()):
            continue
        marker = f"fault.{index}" + (f".{WID}" if rank == "*" else "")
        try:
            fd = os.open(os.path.join(OUT, marker), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, WID.encode())
            os.close(fd)
        except FileExistsError:
            continue
        if mode == "exit":
            os._exit(3)
        if mode == "raise":
            raise RuntimeError("injected failure")
        if mode == "stuck":
            threading.Event().wait()     # a stuck data loader: the process lives on
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


def pin_visible_devices():
    """JOB_VISIBLE_DEVICES="localhost=0,1;127.0.0.1=2,3": loopback "hosts" that are one
    machine each see their own GPUs, as separate machines would (make gpu-check)."""
    for part in filter(None, os.environ.get("JOB_VISIBLE_DEVICES", "").split(";")):
        host, devices = part.split("=")
        if host == os.environ.get("ELASTIC_HOSTNAME"):
            os.environ["CUDA_VISIBLE_DEVICES"] = devices


def main():
    pin_visible_devices()
    if os.environ.get("ELASTIC_HOSTNAME") == os.environ.get("JOB_DIE_ON_HOST", "-"):
        os._exit(5)   # a newcomer that dies before it is ready
    if os.environ.get("ELASTIC_HOSTNAME") == os.environ.get("JOB_BAD_IFACE_HOST", "-"):
        os.environ["GLOO_SOCKET_IFNAME"] = "bogus0"
    elastic.init()
    if os.environ.get("JOB_SECRET_OUT"):
        # Tests that act as the driver read the workers' key here: it is gone from our
        # environment (and /proc/PID/environ) once elastic.init() read it.
        from elastic.control_store import read_secret_from_env
        with open(os.path.join(OUT, f"secret.{WID}"), "wb") as f:
            f.write(read_secret_from_env())
        with open(os.path.join(OUT, f"child-env.{WID}"), "wb") as f:    # what a child inherits
            subprocess.run(["env"], stdout=f, check=True)
    first = {k: v for k, v in os.environ.items() if k.startswith("ELASTIC_") and "SECRET" not in k}
    with open(os.path.join(OUT, f"env.{WID}.json"), "w") as f:
        json.dump({"start": first, "rank": elastic.rank(), "size": elastic.size(),
                   "joined": {k: os.environ[k] for k in first}}, f)
    torch.manual_seed(0)
    data = torch.randn(SAMPLES, 8)
    target = data.sum(dim=1, keepdim=True)
    device = job_device()
    data, target = data.to(device), target.to(device)
    torch.manual_seed(1234 + int(os.environ.get("ELASTIC_RANK", "0")) + hash(WID) % 97)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    dist_opt = elastic.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=7)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0, history=[],
                               epochs=EPOCHS, **({"gate": SyncGate()} if SYNC_GATE else {}))
    log = open(os.path.join(OUT, f"steps.{WID}.jsonl"), "a", buffering=1)

    def reset_fault():
        """JOB_RESET_FAULT=R: rank R fails once while the job re-initialises."""
        rank = os.environ.get("JOB_RESET_FAULT")
        marker = os.path.join(OUT, "reset_fault.fired")
        if rank is not None and elastic.rank() == int(rank) and not os.path.exists(marker):
            open(marker, "w").close()
            raise elastic.WorkersDepartedError("injected failure during re-initialisation")

    state.register_reset_callbacks([reset_fault])

    @elastic.run
    def train(state):
        while state.epoch < state.epochs:
            state.sampler.set_epoch(state.epoch)
            indices = list(state.sampler)
            for start in range(0, len(indices), BATCH):
                batch = indices[start:start + BATCH]
                if RANK0_PHASE and state.step == RANK0_PHASE[0] and elastic.rank() == 0:
                    time.sleep(RANK0_PHASE[1])     # an evaluation only rank 0 runs
                step = state.step + 1
                maybe_fault(step)
                if ALWAYS_RAISE and (step, elastic.rank()) == (ALWAYS_RAISE[0], ALWAYS_RAISE[1]):
                    raise RuntimeError(f"rank {elastic.rank()} always fails at step {step}")
                if SLOW[0] == os.environ.get("ELASTIC_HOSTNAME"):
                    time.sleep(float(SLOW[1]))
                if BAD_ROOT and step >= BAD_ROOT:
                    elastic.broadcast(torch.zeros(1), elastic.size() + 4)
                if os.path.exists(os.path.join(OUT, f"stuck.{WID}")):
                    threading.Event().wait()
                dist_opt.zero_grad()
                x = data[batch]
                loss = torch.nn.functional.mse_loss(model(x), target[batch])
                loss.backward()
                dist_opt.step()
                everyone = elastic.allgather_object(batch)
                state.sampler.record_indices(batch)
                state.step = step
                elastic.report_progress(step=step, samples=len(everyone) * BATCH, loss=loss.item())
                state.history.append([state.epoch, step, sorted(i for b in everyone for i in b)])
                w = elastic.worker.runtime.worker()
                log.write(json.dumps({
                    "epoch": state.epoch, "step": step, "rank": elastic.rank(),
                    "size": elastic.size(), "host": os.environ.get("ELASTIC_HOSTNAME", ""),
                    "local_rank": elastic.local_rank(), "round": w.round_id if w else 0,
                    "worker": WID, "t": time.time(),
                    "received": state.sync_stats["bytes_received"]}) + "\n")
                if step == GATE:
                    while not os.path.exists(os.path.join(OUT, "gate")):
                        time.sleep(0.05)
                if step in HOLDS:
                    hold(state, os.path.join(OUT, f"go.{step}"))
                elif step % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            if END_FILE:
                end = torch.tensor([1 if os.path.exists(END_FILE) else 0])
                if int(elastic.broadcast(end, 0)):
                    state.epochs = state.epoch
            state.commit()

    train(state)
    rank = elastic.rank()
    with open(os.path.join(OUT, f"final.{rank}.json"), "w") as f:
        json.dump({"params": digest(list(model.parameters())),
                   "optimizer": digest(optimizer_tensors(optimizer)),
                   "sampler": state.sampler.state_dict(), "size": elastic.size(),
                   "step": state.step, "worker": WID}, f)
    if rank == 0:
        with open(os.path.join(OUT, "history.json"), "w") as f:
            json.dump(state.history, f)
    sys.stdout.write(f"worker {WID} finished as rank {rank} of {elastic.size()}\n")
    sys.stdout.flush()
    while os.environ.get("JOB_END_GATE") and not os.path.exists(os.path.join(OUT, "end-go")):
        time.sleep(0.05)


if __name__ == "__main__":
    main()
