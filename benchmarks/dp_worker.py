"""Worker of the harness-run benchmarks (steady state, sync, model-size scan, growth).

Usage: dp_worker.py MODE[,MODE...] [key=value ...]; writes $BENCH_OUT/result.<rank>.json.
Modes:
  steady  DistributedOptimizer vs torch DDP (its own init_process_group over its own
          TCPStore), same model, data and world size, repeats interleaved; fp16 wire bytes
  sync    newcomer sync (last rank fresh, version -1) vs a raw gloo broadcast of one
          buffer of the same size; no-change sync bytes
  scan    commit and newcomer sync vs model size (1M/10M/100M fp32 parameters)
  growth  step, commit and newcomer sync time at this world size
"""

import gc
import os
import resource
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import elastic  # noqa: E402
import elastic.state.states as estate  # noqa: E402
from elastic.state.states import TorchState  # noqa: E402

OUT = os.environ["BENCH_OUT"]
now = time.perf_counter


def opts(argv):
    return dict(a.split("=", 1) for a in argv)


# -- steady state -------------------------------------------------------------------------
def steady(res, o):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    reps, steps, batch = int(o.get("reps", 5)), int(o.get("steps", 4)), int(o.get("batch", 16))
    rank, size = elastic.rank(), elastic.size()
    # torch DDP gets a gloo group of its own, as under torchrun: where the round's group
    # is already torch's default group, a new group beside it; else a job of its own.
    own = not dist.is_initialized()
    if own:
        store = dist.TCPStore(os.environ.get("BENCH_DDP_ADDR", "127.0.0.1"),
                              int(os.environ["BENCH_DDP_PORT"]), size, rank == 0,
                              timeout=timedelta(seconds=120), use_libuv=True)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    ddp_group = None if own else dist.new_group(backend="gloo")
    kinds = o.get("kinds", "mlp:cnn:deep").split(":")
    for kind, build in (("mlp", common.mlp_10m), ("cnn", common.small_cnn),
                        ("deep", common.deep_64)):
        if kind not in kinds:
            continue
        torch.manual_seed(0)
        m_e, m_d, m_f = build(), build(), build()
        m_d.load_state_dict(m_e.state_dict())
        m_f.load_state_dict(m_e.state_dict())

        def sgd(m):
            return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        opt_e = elastic.DistributedOptimizer(sgd(m_e), named_parameters=m_e.named_parameters())
        opt_f = elastic.DistributedOptimizer(sgd(m_f), named_parameters=m_f.named_parameters(),
                                             compression=elastic.Compression.fp16)
        ddp = DDP(m_d, process_group=ddp_group)
        opt_d = sgd(ddp)
        batches = [common.batch_for(kind, batch, 1000 * rank + i) for i in range(4)]

        def runner(model, opt, batches=batches):
            def run(n):
                for i in range(n):
                    x, y = batches[i % len(batches)]
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
            return run

        sides = {"elastic": runner(m_e, opt_e), "ddp": runner(ddp, opt_d)}
        if o.get("edp") == "1" and not own:    # elastic.DDP: torch's DDP on the round's group
            m_x = build()
            m_x.load_state_dict(m_e.state_dict())
            edp = elastic.DDP(m_x)
            sides["elastic.DDP"] = runner(edp, sgd(edp))
        fp16 = runner(m_f, opt_f)
        fp16(1)
        for warm in sides.values():
            warm(3)  # warm-up: buckets, gloo connections, allocator
        times = {k: [] for k in sides}
        for rep in range(int(o.get(f"reps_{kind}", reps))):
            order = list(sides)[rep % len(sides):] + list(sides)[:rep % len(sides)]
            for name in order:
                dist.barrier(group=ddp_group)
                t0 = now()
                sides[name](steps)
                times[name].append((now() - t0) / steps)
        b0, f0 = opt_e.wire_bytes, opt_f.wire_bytes
        sides["elastic"](2)
        fp16(2)
        res[kind] = {"params": common.n_params(m_e), "step_s": times,
                     "wire_bytes_per_step": (opt_e.wire_bytes - b0) / 2,
                     "wire_bytes_fp16_per_step": (opt_f.wire_bytes - f0) / 2,
                     "buckets": opt_e.bucket_count}
        del m_e, m_d, m_f, opt_e, opt_d, opt_f, ddp, sides, fp16
        gc.collect()
    if own:
        dist.destroy_process_group()


# -- sync ---------------------------------------------------------------------------------
class Phases:
    """Times the parts of a sync by wrapping functions the state module calls."""

    def __init__(self):
        self.t = {}
        orig_pack = estate.pack

        def pack(tree):
            t0 = now()
            try:
                return orig_pack(tree)
            finally:
                self.add("pack", now() - t0)
        estate.pack = pack

    def add(self, key, dt):
        self.t[key] = self.t.get(key, 0.0) + dt

    def watch(self, state):
        for name in ("restore", "apply", "save"):
            orig = getattr(state, name)

            def wrapped(*a, _orig=orig, _name=name, **k):
                t0 = now()
                try:
                    return _orig(*a, **k)
                finally:
                    self.add(_name, now() - t0)
            setattr(state, name, wrapped)
        return state

    def take(self):
        t, self.t = self.t, {}
        return t


def one_step(model, opt, kind):
    x, y = common.batch_for(kind, 8, 7)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


RAW_CPU = {True: [], False: []}   # the receiver's CPU seconds per raw broadcast, by ``fresh``


def cpu_s():
    """This process's user + system CPU seconds (page faults show up as system time)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def raw_broadcast_s(buf, fresh=False):
    """A plain gloo broadcast on the round's group, root 0, timed where it is received
    (on every rank; the last rank is the one reported).

    fresh=True: non-roots receive into newly allocated memory (page faults included).
    """
    w = elastic.worker.runtime.worker()
    o = torch.distributed.BroadcastOptions()
    o.rootRank, o.rootTensor = 0, 0
    gc.collect()
    elastic.barrier()
    t0, c0 = now(), cpu_s()
    if fresh and elastic.rank() != 0:
        buf = torch.empty_like(buf)
    w.cpu_group.broadcast([buf], o).wait()
    dt = now() - t0
    RAW_CPU[fresh].append(cpu_s() - c0)
    return dt


def newcomer_sync_s(state, make_fresh, phases, newcomers=None):
    """The ``newcomers`` (default: the last rank) start over (fresh objects, version -1)
    and sync; the others hold the commit."""
    if newcomers is None:
        newcomers = {elastic.size() - 1}
    if elastic.rank() in newcomers:
        state = phases.watch(make_fresh())
    gc.collect()
    elastic.barrier()
    phases.take()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = now(), cpu_s()
    state.sync()
    dt = now() - t0
    ph = phases.take()
    ph["cpu"] = cpu_s() - c0
    ph["minflt"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0   # page faults
    ph["received_into"] = state.sync_stats.get("received_into")
    ph["copied_into"] = state.sync_stats.get("copied_into")
    return state, dt, ph


def sync(res, o):
    """Ranks below ``holders`` hold the same commit; the others sync as newcomers, once
    per sender count in ``ks`` per repeat (ELASTIC_SYNC_MAX_SENDERS)."""
    reps = int(o.get("reps", 5))
    holders = int(o.get("holders", 1))
    ks = [int(k) for k in o.get("ks", "8").split(":")]
    phases = Phases()
    rank, size = elastic.rank(), elastic.size()
    newcomers = set(range(holders, size))

    kind = o.get("model", "mlp")                    # mlp: 10M params; mlp1m: 1M

    def fresh():
        torch.manual_seed(100 + rank)
        model = {"mlp": common.mlp_10m, "mlp1m": common.mlp_1m}[kind]()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return TorchState(model, opt, step=0)

    state = fresh()
    state.sync()                                    # rank 0's model everywhere
    one_step(state.model, state.optimizer, kind)    # the same step: Adam state everywhere
    state.commit()
    nbytes = state.snapshot.nbytes()
    buf = torch.full((nbytes // 4,), float(rank))
    raw_broadcast_s(buf)                            # warm the path once
    by_k = {k: [] for k in ks}
    sent = {k: [] for k in ks}
    bcast_s, fresh_s, parts, separate_s = [], [], [], []
    mine = state
    for rep in range(reps):
        if rep % 2:
            bcast_s.append(raw_broadcast_s(buf))
            fresh_s.append(raw_broadcast_s(buf, fresh=True))
        for k in (ks if rep % 2 == 0 else ks[::-1]):
            os.environ["ELASTIC_SYNC_MAX_SENDERS"] = str(k)
            before = mine.sync_stats["bytes_sent"] if rank not in newcomers else 0
            mine, dt, ph = newcomer_sync_s(state, fresh, phases, newcomers)
            by_k[k].append(dt)
            sent[k].append(mine.sync_stats["bytes_sent"] - before)
            parts.append(ph)
        if o.get("separate"):       # the same newcomers one at a time, from one sender
            os.environ["ELASTIC_SYNC_MAX_SENDERS"] = "1"
            for n in sorted(newcomers):
                _mine, dt, _ph = newcomer_sync_s(state, fresh, phases, {n})
                if n == rank:
                    separate_s.append(dt)
        if rep % 2 == 0:
            fresh_s.append(raw_broadcast_s(buf, fresh=True))
            bcast_s.append(raw_broadcast_s(buf))
    os.environ.pop("ELASTIC_SYNC_MAX_SENDERS", None)
    # Everyone now holds the same commit: a sync must move nothing.
    before = dict(mine.sync_stats)
    elastic.barrier()
    t0 = now()
    mine.sync()
    noop_s = now() - t0
    after = mine.sync_stats
    moved = (after["bytes_sent"] - before["bytes_sent"]) + \
        (after["bytes_received"] - before["bytes_received"])
    commit_s = []
    for _ in range(3):
        elastic.barrier()
        t0 = now()
        mine.commit()
        commit_s.append(now() - t0)
    res["sync"] = {"bytes": nbytes, "sync_s": by_k[ks[0]], "by_k": by_k, "sent": sent,
                   "bcast_cpu_s": RAW_CPU[False][1:], "bcast_fresh_cpu_s": RAW_CPU[True],
                   "bcast_s": bcast_s, "phases": parts, "bcast_fresh_s": fresh_s,
                   "noop_moved_bytes": moved, "separate_s": separate_s, "noop_sync_s": noop_s,
                   "commit_s": commit_s,
                   "stats": mine.sync_stats}


def scan(res, o):
    sizes = [int(s) for s in o.get("sizes", "1,10,100").split(":")]
    phases = Phases()
    out = {}
    for k in sizes:
        reps = 2 if k >= 100 else 3

        def fresh(k=k):
            model = common.blocks(k)
            return TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), step=0)
        state = fresh()
        state.commit()  # allocates the snapshot buffers
        commit_s = []
        for _ in range(reps):
            elastic.barrier()
            t0 = now()
            state.commit()
            commit_s.append(now() - t0)
        sync_s = []
        for _ in range(reps):
            mine, dt, _ph = newcomer_sync_s(state, fresh, phases)
            sync_s.append(dt)
            del mine
        out[k] = {"bytes": state.snapshot.nbytes(), "commit_s": commit_s, "sync_s": sync_s}
        del state
        gc.collect()
    res["scan"] = out


def growth(res, o):
    steps, reps = int(o.get("steps", 6)), int(o.get("reps", 3))
    rank = elastic.rank()
    phases = Phases()

    def fresh():
        torch.manual_seed(0)
        model = common.mlp_1m()
        opt = elastic.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                           named_parameters=model.named_parameters())
        return TorchState(model, opt, step=0)
    state = fresh()
    x, y = common.batch_for("mlp1m", 32, rank)

    def train(n):
        for _ in range(n):
            state.optimizer.zero_grad()
            F.cross_entropy(state.model(x), y).backward()
            state.optimizer.step()
    train(2)
    step_s = []
    for _ in range(reps):
        elastic.barrier()
        t0 = now()
        train(steps)
        step_s.append((now() - t0) / steps)
    state.commit()
    commit_s = []
    for _ in range(reps + 2):
        elastic.barrier()
        t0 = now()
        state.commit()
        commit_s.append(now() - t0)
    sync_s = []
    for _ in range(reps):
        _mine, dt, _ph = newcomer_sync_s(state, fresh, phases)
        sync_s.append(dt)
    res["growth"] = {"size": elastic.size(), "bytes": state.snapshot.nbytes(), "step_s": step_s,
                     "commit_s": commit_s, "sync_s": sync_s}


def main():
    modes, o = sys.argv[1].split(","), opts(sys.argv[2:])
    elastic.init()
    res = {"rank": elastic.rank(), "size": elastic.size()}
    for mode in modes:
        t0 = now()
        {"steady": steady, "sync": sync, "scan": scan, "growth": growth}[mode](res, o)
        res.setdefault("mode_s", {})[mode] = now() - t0
        elastic.barrier()
    common.write_json(os.path.join(OUT, f"result.{elastic.rank()}.json"), res)


if __name__ == "__main__":
    main()
