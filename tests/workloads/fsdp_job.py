"""An FSDP2 training script made elastic: the workload of tests/test_fsdp.py.

Three fully_shard-ed Linear layers (rows that split unevenly at 3, 4 and 5
workers) and AdamW in float32, trained at a constant global batch: every step
trains the same G samples at any world size, each rank its share, with the loss
scaled so that FSDP2's gradient average is the global batch's mean.

Writes to $JOB_OUT: steps.<worker>.jsonl (one line per step), final.<rank>.json
(full parameters and optimizer state gathered at the end by full_tensor(), whether
this rank's shards equal its rows of them, the shards allgathered and the model's
full state dict, the global batches). FSDP_HOLD="5:5,6:4" keeps
committing after those steps until the world has 5, then 4 workers; FSDP_KILL=step:rank
SIGKILLs that rank once, mid-backward (step:1+2 kills both ranks at once); FSDP_TERM=step:1+2
sends those ranks SIGTERM before that step's commit, so they all leave at it; FSDP_CKPT=DIR
writes each rank's shards there (and a job that starts with nothing in memory resumes
from them).
"""

import json
import os
import signal
import time

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import elastic
from elastic.state.shard_plan import rows

OUT = os.environ["JOB_OUT"]
STEPS = int(os.environ.get("FSDP_STEPS", "8"))
SAMPLES, GLOBAL_BATCH = 120, 60
HOLDS = dict(tuple(int(v) for v in s.split(":"))
             for s in os.environ.get("FSDP_HOLD", "").split(",") if s)
KILL_STEP, _, KILL_RANKS = os.environ.get("FSDP_KILL", "0:").partition(":")
KILL_STEP, KILL_RANKS = int(KILL_STEP), [int(r) for r in KILL_RANKS.split("+") if r]
TERM_STEP, _, TERM_RANKS = os.environ.get("FSDP_TERM", "0:").partition(":")
TERM_STEP, TERM_RANKS = int(TERM_STEP), [int(r) for r in TERM_RANKS.split("+") if r]
WID = os.environ.get("ELASTIC_WORKER_ID", "solo")


def build(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def main():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=gen)
    y = torch.sin(x[:, :3] * 2)
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=1,
                                     global_batch_size=GLOBAL_BATCH)
    state = elastic.ShardedState(build, checkpoint_dir=os.environ.get("FSDP_CKPT"),
                                 sampler=sampler, epoch=0, step=0, batches=[])
    log = open(os.path.join(OUT, f"steps.{WID}.jsonl"), "a", buffering=1)

    def train_step():
        model, optimizer = state.model, state.optimizer
        size = elastic.size()
        batch = state.sampler.global_batch_indices(0)
        mine = state.sampler.share_of(batch)
        optimizer.zero_grad()
        killing = state.step + 1 == KILL_STEP and elastic.rank() in KILL_RANKS and \
            not os.path.exists(os.path.join(OUT, "killed"))
        if killing:
            with open(os.path.join(OUT, f"pid.{elastic.rank()}"), "w") as f:
                f.write(str(os.getpid()))
        per_sample = ((model(x[mine]) - y[mine]) ** 2).mean(dim=1)
        loss = per_sample.sum() * size / GLOBAL_BATCH     # FSDP2 averages over ranks
        if killing and elastic.rank() == KILL_RANKS[0]:
            # Every rank to kill wrote its pid before this forward's collectives: they
            # all die at once, while their peers are in this backward.
            open(os.path.join(OUT, "killed"), "w").close()
            for r in KILL_RANKS[::-1]:
                with open(os.path.join(OUT, f"pid.{r}")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        state.sampler.record_global_batch()
        state.step += 1
        state.batches.append(batch)
        w = elastic.worker.runtime.worker()
        log.write(json.dumps({"step": state.step, "rank": elastic.rank(), "size": size,
                              "round": w.round_id if w else 0,
                              "worker": WID, "builds": state.stats["builds"],
                              "held": state.held_bytes(),
                              "reshard_received": state.stats["reshard_received"],
                              "handed_off": state.stats["handed_off"]}) + "\n")
        if state.step == TERM_STEP and elastic.rank() in TERM_RANKS:
            os.kill(os.getpid(), signal.SIGTERM)     # these ranks all leave at this commit
        state.commit()

    def hold():
        """After step s of FSDP_HOLD, commit (no training) until the world has its size:
        a commit raises for each new round, and the loop comes back here."""
        while elastic.size() != HOLDS.get(state.step, elastic.size()):
            state.commit()
            time.sleep(0.05)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            state.sampler.set_epoch(state.epoch)
            while state.sampler.global_batches_left > 0 and state.step < STEPS:
                hold()
                train_step()
            if state.sampler.global_batches_left == 0:
                state.epoch += 1
                state.commit()

    train(state)
    model, optimizer = state.model, state.optimizer
    rank, size = elastic.rank(), elastic.size()
    # Full tensors by DTensor.full_tensor() (over the round's group), checked against an
    # allgather of every rank's local shard, and whether this rank's shard equals its rows.
    local, full = {}, {}
    for name, p in model.named_parameters():
        local[name], full[name] = p.to_local(), p.full_tensor()
        for k, v in optimizer.state[p].items():
            if k != "step":
                local[f"{name}/{k}"], full[f"{name}/{k}"] = v.to_local(), v.full_tensor()
    shards = elastic.allgather_object({k: v.tolist() for k, v in local.items()})
    gathered = {k: torch.cat([torch.tensor(s[k]).reshape(-1, *v.shape[1:]) for s in shards])
                for k, v in local.items()}
    agree = all(torch.equal(full[k][slice(*rows(full[k].shape[0], size, rank))], v) and
                torch.equal(full[k], gathered[k]) for k, v in local.items())
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    agree = agree and all(torch.equal(whole[k], full[k]) for k in whole)
    params = {k: v.flatten().tolist() for k, v in full.items() if "/" not in k}
    moments = {k: v.flatten().tolist() for k, v in full.items() if "/" in k}
    with open(os.path.join(OUT, f"final.{rank}.json"), "w") as f:
        json.dump({"params": params, "moments": moments, "agree": agree,
                   "sampler": state.sampler.state_dict(), "batches": state.batches,
                   "step": state.step, "size": size, "worker": WID,
                   "resumed_from": state.stats["resumed_from"]}, f)


if __name__ == "__main__":
    main()
