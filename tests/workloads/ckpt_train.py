"""Deterministic job for tests/test_checkpoint.py: the same run gives the same bits.

Every rank builds the same model (seed 0) on fixed data; AdamW; ElasticSampler;
a commit after every step. Checkpoints come from $ELASTIC_CHECKPOINT_DIR
(elasticrun --checkpoint-dir), with the default policy.
Env: JOB_OUT, JOB_EPOCHS (6), JOB_SAMPLES (64), JOB_BATCH (4), JOB_STEP_SLEEP (0),
     JOB_HOLD=step: after that step, keep committing until $JOB_OUT/go exists.
     JOB_KILL_RANK0_AT=step: rank 0 SIGKILLs itself before that step (once per job).
     JOB_WIDTH (32): the hidden layer's width (another width: another model).
Writes to $JOB_OUT: steps.<worker>.jsonl (one line per step, as tests/support/jobs.py reads),
final.<rank>.json (digests, step, sampler, checkpoint info), history.json (rank 0:
the committed history (epoch, step, sample ids)).
"""

import json
import os
import signal
import time

import torch
from job_helpers import digest, hold, job_device

import elastic

OUT = os.environ["JOB_OUT"]
EPOCHS = int(os.environ.get("JOB_EPOCHS", "6"))
SAMPLES = int(os.environ.get("JOB_SAMPLES", "64"))
BATCH = int(os.environ.get("JOB_BATCH", "4"))
STEP_SLEEP = float(os.environ.get("JOB_STEP_SLEEP", "0"))
HOLD = int(os.environ.get("JOB_HOLD", "0"))
KILL_RANK0_AT = int(os.environ.get("JOB_KILL_RANK0_AT", "0"))
WID = os.environ.get("ELASTIC_WORKER_ID", "solo")


def main():
    elastic.init()
    torch.manual_seed(0)
    data = torch.randn(SAMPLES, 8)
    target = data.sum(dim=1, keepdim=True)
    device = job_device()
    data, target = data.to(device), target.to(device)
    width = int(os.environ.get("JOB_WIDTH", "32"))
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    dist_opt = elastic.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=7)
    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0, history=[])
    log = open(os.path.join(OUT, f"steps.{WID}.jsonl"), "a", buffering=1)

    @elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            state.sampler.set_epoch(state.epoch)
            indices = list(state.sampler)
            for start in range(0, len(indices), BATCH):
                batch = indices[start:start + BATCH]
                if state.step + 1 == KILL_RANK0_AT and elastic.rank() == 0 and not os.path.exists(
                        os.path.join(OUT, "killed")):
                    open(os.path.join(OUT, "killed"), "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                dist_opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(data[batch]), target[batch])
                loss.backward()
                dist_opt.step()
                everyone = elastic.allgather_object(batch)
                state.sampler.record_indices(batch)
                state.step += 1
                state.history.append([state.epoch, state.step,
                                      sorted(i for b in everyone for i in b)])
                w = elastic.worker.runtime.worker()
                log.write(json.dumps({
                    "epoch": state.epoch, "step": state.step, "rank": elastic.rank(),
                    "size": elastic.size(), "round": w.round_id if w else 0,
                    "local_rank": elastic.local_rank(), "worker": WID}) + "\n")
                time.sleep(STEP_SLEEP)
                state.commit()
                if state.step == HOLD:
                    hold(state, os.path.join(OUT, "go"))
            state.epoch += 1
            state.commit()

    train(state)
    rank = elastic.rank()
    ckpt = state.checkpointer
    with open(os.path.join(OUT, f"final.{rank}.json"), "w") as f:
        json.dump({"params": digest(list(model.parameters())),
                   "optimizer": digest([v for s in optimizer.state.values()
                                        for _k, v in sorted(s.items())]),
                   "sampler": state.sampler.state_dict(), "size": elastic.size(),
                   "step": state.step, "worker": WID, "pid": os.getpid(),
                   "resumed_from": ckpt.resumed_from if ckpt else None,
                   "stats": ckpt.stats if ckpt else None}, f, default=str)
    if rank == 0:
        with open(os.path.join(OUT, "history.json"), "w") as f:
            json.dump(state.history, f)


if __name__ == "__main__":
    main()
