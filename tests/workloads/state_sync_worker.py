"""Two-rank worker for tests/test_state.py: TorchState.sync on real gloo groups.

Runs every scenario in order and writes $STATE_OUT/rank<r>.json with digests and
sync statistics; the test process compares the ranks. Phases:
  initial    every rank seeds its model differently, then syncs from version -1
  newcomer   after 3 joint steps + commits, rank 1 starts over (fresh model,
             empty AdamW state, version -1) and syncs, receiving into the buffers it
             reserved at construction from rank 0's published spec, and loading its
             optimizer state into the arena reserved with them; then every rank
             changes its live state locally and rolls back (a crash right after the sync)
  noop       all ranks at the same commit: a sync moves nothing
  newest     rank 1 alone holds a newer commit: it is the root
Every rank calls commit() the same number of times (it runs a collective).
"""

import hashlib
import json
import os
import sys
import traceback

import torch

import elastic
from elastic.state.states import TorchState
from elastic.training.sampler import ElasticSampler
from elastic.worker import collectives

OUT = os.environ["STATE_OUT"]
DATASET = list(range(64))
BATCH = 4


def digest_tensors(tensors):
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def params_digest(model):
    return digest_tensors([v for _k, v in sorted(model.state_dict().items())])


def opt_state(opt):
    """Per parameter, per key: a digest of each state tensor, plus the param groups."""
    sd = opt.state_dict()
    state = {}
    for idx, entry in sorted(sd["state"].items()):
        state[str(idx)] = {k: (digest_tensors([v]) if torch.is_tensor(v) else repr(v))
                           for k, v in sorted(entry.items())}
    groups = [{k: (v if k == "params" else repr(v)) for k, v in sorted(g.items())}
              for g in sd["param_groups"]]
    return {"state": state, "groups": groups}


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sampler = ElasticSampler(DATASET, shuffle=True, seed=3)
    state = TorchState(model, opt, sampler=sampler, epoch=0, batch=0)
    return state


def train_step(state, step):
    """One data-parallel step: gradients averaged across ranks, so ranks stay equal."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 2, generator=g)
    state.optimizer.zero_grad()
    ((state.model(x) - y) ** 2).mean().backward()
    for p in state.model.parameters():
        collectives.allreduce_(p.grad, collectives.Average)
    state.optimizer.step()
    state.sampler.record_batch(step, BATCH)
    state.batch += 1


def summary(state):
    return {
        "params": params_digest(state.model),
        "opt": opt_state(state.optimizer),
        "sampler": state.sampler.state_dict(),
        "epoch": state.epoch,
        "batch": state.batch,
        "version": state.commit_version,
        "stats": dict(state.sync_stats),
        "opt_storages": len({v.untyped_storage().data_ptr() for entry in
                             state.optimizer.state.values() for v in entry.values()
                             if torch.is_tensor(v)}),
    }


def local_step(state):
    """Change everything a step changes, with no collective (one rank may do it alone)."""
    for p in state.model.parameters():
        p.grad = torch.full_like(p, 0.5)
    state.optimizer.step()
    state.sampler.record_batch(0, BATCH)
    state.batch += 1
    state.epoch += 1


def delta(before, after):
    return {k: after[k] - before[k] for k in ("bytes_received", "bytes_sent")}


def main():
    elastic.init()
    rank = elastic.rank()
    out = {"rank": rank, "size": elastic.size()}

    # -- (i) initial sync: different seeds, version -1 everywhere -----------------------------
    state = build(seed=100 + rank)
    out["initial_before"] = summary(state)
    state.sync()
    out["initial_after"] = summary(state)

    # -- (ii) a newcomer with empty AdamW state ------------------------------------------------
    for step in range(3):
        train_step(state, step)
        state.commit()
    out["trained"] = summary(state)
    if rank == 1:
        state = build(seed=555)  # fresh model, empty optimizer state, version -1
    out["newcomer_before"] = summary(state)
    before = dict(state.sync_stats)
    state.sync()
    out["newcomer_after"] = summary(state)
    out["newcomer_delta"] = delta(before, state.sync_stats)
    # A crash right after the sync: the run loop restores the last commit, which must
    # be exactly the commit just received, not what the live objects did since.
    local_step(state)
    out["rollback_changed"] = summary(state)
    state.restore()
    out["rollback_after_sync"] = summary(state)
    # The synced optimizer must behave identically: one more joint step keeps ranks equal.
    train_step(state, 3)
    state.commit()
    out["newcomer_next_step"] = summary(state)
    # The sync also refreshed the snapshot: restore goes back to the commit just made.
    committed = params_digest(state.model)
    train_step(state, 4)
    state.restore()
    out["restore_after_sync"] = {"committed": committed, "restored": params_digest(state.model)}

    # -- (iii) same commit everywhere: a sync moves nothing -----------------------------------
    train_step(state, 5)
    state.commit()
    before = dict(state.sync_stats)
    pre = summary(state)
    state.sync()
    out["noop"] = {"before": pre, "after": summary(state),
                   "delta": delta(before, state.sync_stats)}

    # -- (iv) the newest commit wins even when it is not on rank 0 ----------------------------
    for step in range(6, 8):
        train_step(state, step)
        state.commit()
    if rank == 1:
        with torch.no_grad():
            next(state.model.parameters()).add_(0.25)
        state.epoch = 7
        state.batch = 1234
        state.adopt(state.capture(), state.commit_version + 1)   # the newest commit
    before = dict(state.sync_stats)
    out["newest_before"] = summary(state)
    state.sync()
    out["newest_after"] = summary(state)
    out["newest_delta"] = delta(before, state.sync_stats)

    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
