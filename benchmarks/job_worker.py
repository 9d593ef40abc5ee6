"""elasticrun workload for the recovery and scale-up benchmarks.

Writes under $BENCH_OUT, one JSON line per event, wall-clock (time.time()) stamps:
  start.<wid>        process start (before `import torch`) and when imports finished
  steps.<wid>.jsonl  one line per completed step: step, rank, size, round, wid, t_start
                     (the loop body began) and t (it ended, before the step's commit)
  events.<wid>.jsonl interrupt (HostsUpdatedInterrupt raised by commit), restore (a
                     failure noticed and reported), groups_start/groups_end (every member
                     arrived: the round's gloo group forms and checks), joined (new round
                     formed), sync start/end with bytes moved
  kill.json          written by the rank that SIGKILLs itself, just before it does
Knobs: BENCH_KILL="step:rank" kills that rank at the start of that step (once per job);
BENCH_STEP_SLEEP stands in for compute; a file $BENCH_OUT/stuck.<wid> blocks that
worker's training thread (its heartbeat lives on) while it exists; the job ends when $BENCH_OUT/stop exists
(rank 0 decides, every rank learns it by broadcast) or after BENCH_MAX_STEPS.
BENCH_MODEL=mlp10m trains benchmarks/common.py's 10M MLP (120 MB of state with Adam).
"""

import json
import os
import signal
import sys
import time

T_START = time.time()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import elastic  # noqa: E402
from elastic.exceptions import HostsUpdatedInterrupt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

T_IMPORTED = time.time()
OUT = os.environ["BENCH_OUT"]
WID = os.environ.get("ELASTIC_WORKER_ID", "solo")
KILL = os.environ.get("BENCH_KILL", "")
SLEEP = float(os.environ.get("BENCH_STEP_SLEEP", "0.01"))
MAX_STEPS = int(os.environ.get("BENCH_MAX_STEPS", "5000"))
MODEL = os.environ.get("BENCH_MODEL", "tiny")


def line_log(name):
    return open(os.path.join(OUT, name), "a", buffering=1)


EVENTS = line_log(f"events.{WID}.jsonl")


def event(what, **kw):
    w = elastic.worker.runtime.worker()
    EVENTS.write(json.dumps({"what": what, "t": time.time(), "wid": WID,
                             "round": w.round_id if w else 0, **kw}) + "\n")


class TimedState(elastic.TorchState):
    """Records when the round changes and how long each sync takes."""

    def commit(self):
        try:
            super().commit()
        except HostsUpdatedInterrupt:
            event("interrupt")
            raise

    def restore(self):
        event("restore")
        super().restore()

    def sync(self):
        before = dict(self.sync_stats)
        event("sync_start")
        super().sync()
        event("sync_end", received=self.sync_stats["bytes_received"] - before["bytes_received"],
              sent=self.sync_stats["bytes_sent"] - before["bytes_sent"])


def maybe_kill(step):
    if not KILL:
        return
    at, rank = (int(v) for v in KILL.split(":"))
    if step != at or elastic.rank() != rank:
        return
    try:
        fd = os.open(os.path.join(OUT, "kill.lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    w = elastic.worker.runtime.worker()
    with open(os.path.join(OUT, "kill.tmp"), "w") as f:
        json.dump({"t": time.time(), "wid": WID, "step": step,
                   "round": w.round_id if w else 0}, f)
    os.replace(os.path.join(OUT, "kill.tmp"), os.path.join(OUT, "kill.json"))
    os.kill(os.getpid(), signal.SIGKILL)


def time_group_setup():
    """Events around the round's group set-up (form_groups runs once every member arrived)."""
    w = elastic.worker.runtime.worker()
    if w is None:
        return
    form = w.form_groups

    def timed(round_id):
        event("groups_start", round_id=round_id)
        groups = form(round_id)
        event("groups_end", round_id=round_id)
        return groups
    w.form_groups = timed


def main():
    with open(os.path.join(OUT, f"start.{WID}"), "w") as f:
        json.dump({"t_start": T_START, "t_imported": T_IMPORTED, "pid": os.getpid(),
                   "host": os.environ.get("ELASTIC_HOSTNAME")}, f)
    elastic.init()
    time_group_setup()
    torch.manual_seed(0)
    if MODEL == "mlp10m":          # 120 MB of state with Adam: the sync-pause row
        model = common.mlp_10m()
    else:
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10))
    optimizer = elastic.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                             named_parameters=model.named_parameters())
    state = TimedState(model, optimizer, step=0)
    state.register_reset_callbacks([lambda: event("joined", size=elastic.size())])
    g = torch.Generator().manual_seed(int(os.environ.get("ELASTIC_RANK", "0")))
    width = 1024 if MODEL == "mlp10m" else 64
    x, y = torch.randn(32, width, generator=g), torch.randint(0, 10, (32,), generator=g)
    steps = line_log(f"steps.{WID}.jsonl")

    @elastic.run
    def train(state):
        while state.step < MAX_STEPS:
            t_start = time.time()
            step = state.step + 1
            maybe_kill(step)
            while os.path.exists(os.path.join(OUT, f"stuck.{WID}")):
                time.sleep(0.05)        # a stuck training thread; the heartbeat lives on
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            time.sleep(SLEEP)
            stop = torch.tensor([1 if os.path.exists(os.path.join(OUT, "stop")) else 0])
            stop = int(elastic.broadcast(stop, 0))
            state.step = step
            w = elastic.worker.runtime.worker()
            steps.write(json.dumps({"step": step, "rank": elastic.rank(), "size": elastic.size(),
                                    "round": w.round_id if w else 0, "wid": WID,
                                    "t_start": t_start, "t": time.time()}) + "\n")
            state.commit()
            if stop:
                return

    event("ready_to_join")
    train(state)


if __name__ == "__main__":
    main()
