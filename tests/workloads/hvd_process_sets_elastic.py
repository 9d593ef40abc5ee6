"""Process sets across a membership change: 3 workers, rank 2 crashes, 2 carry on.

The sets are registered in the first round that has all 3 workers (a slow
third worker may join the others a round later).

``stale`` is defined by ranks and never re-added: after the change it must
raise ProcessSetStaleError. ``readded`` (every rank) is removed and added
again in a reset callback. ``ruled`` is ProcessSet(lambda size: [0, size - 1]): ranks [0, 2]
in round 1 and [0, 1] after the change, rebuilt by its rule. ``opt`` is a
DistributedOptimizer over ``stale``: it averages ranks 0 and 1, rank 2 steps
alone, and after the change its step() raises ProcessSetStaleError everywhere.
``opt_again`` is one over the set [0] (a second set of [0, 1] in one round is
refused) whose set object is removed and added again in the reset callback: it
keeps stepping after the change.
"""

import json
import os
import time

import torch

import elastic.torch as hvd

OUT = os.environ["JOB_OUT"]
hvd.init()
sets = {}
optimizers = {}
optimizer_sets = {}


def register():
    sets["stale"] = hvd.add_process_set([0, 1])
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizers["opt"] = (weight, hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0),
                                                          process_set=sets["stale"]))
    again = optimizer_sets["again"] = hvd.add_process_set([0])
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizers["opt_again"] = (weight, hvd.DistributedOptimizer(
        torch.optim.SGD([weight], lr=1.0), process_set=again))
    sets["readded"] = hvd.add_process_set(list(range(hvd.size())))
    sets["ruled"] = hvd.add_process_set(hvd.ProcessSet(lambda size: [0, size - 1]))


def on_reset():
    if "again" in optimizer_sets:        # the same object, registered for the new round
        hvd.remove_process_set(optimizer_sets["again"])
        hvd.add_process_set(optimizer_sets["again"])
    if "readded" in sets:
        hvd.remove_process_set(sets["readded"])
        sets["readded"] = hvd.add_process_set(list(range(hvd.size())))


state = hvd.elastic.ObjectState(batch=0)
state.register_reset_callbacks([on_reset])


def try_step(key):
    weight, opt = optimizers[key]
    before = float(weight[0])
    opt.zero_grad()
    (weight * (hvd.rank() + 1)).sum().backward()
    try:
        opt.step()
    except hvd.ProcessSetStaleError as exc:
        return type(exc).__name__
    return before - float(weight[0])


def try_sum(ps):
    if not ps.included():
        return None
    try:
        return int(hvd.allreduce(torch.tensor([hvd.rank() + 1]), op=hvd.Sum, process_set=ps))
    except hvd.ProcessSetStaleError as exc:
        return type(exc).__name__


@hvd.elastic.run
def train(state):
    while hvd.size() < 3 and not sets:
        time.sleep(0.05)     # a slow third worker joins warm, at a commit
        state.commit()
    if not sets:
        register()           # every rank, in the first round of 3
    while state.batch < 5:
        if state.batch == 2 and hvd.size() == 3 and hvd.rank() == 2:
            os._exit(1)
        record = {"size": hvd.size(), "rank": hvd.rank(), "batch": state.batch,
                  "ruled_ranks": sets["ruled"].ranks}
        try:
            for key, ps in sets.items():
                record[key] = try_sum(ps)
            record["opt"] = try_step("opt")
            record["opt_again"] = try_step("opt_again")
        except hvd.HorovodInternalError:     # rank 2 left: the run loop restores and rejoins
            with open(f"{OUT}/departed.{os.getpid()}", "w") as f:
                f.write(str(hvd.rank()))
            raise
        with open(f"{OUT}/ps.{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        state.batch += 1
        state.commit()


train(state)
