"""Constant-global-batch mode: the sampler's split, the gradient weights, and real jobs.

The unit tests simulate ranks in one process. The job tests run real elasticrun
jobs whose world goes 4 -> 2 -> 3 workers (hosts localhost, 127.0.0.1 and this
machine's hostname, all local) and compare them with a fixed 4-worker run.
"""

import contextlib
import importlib.util
import json
import socket
import textwrap

import pytest
import torch
from support.harness import check_ok, run_workers
from support.jobs import REPO, Job, sizes_in_order

import elastic
from elastic.training.sampler import ElasticSampler
from elastic.worker import runtime
from elastic.worker.collectives import Average, Sum

slow = pytest.mark.slow




def ranks(n, size, g, state=None, **kw):
    out = []
    for r in range(size):
        s = ElasticSampler(list(range(n)), global_batch_size=g, **kw)
        if state is not None:
            s.load_state_dict(state)
        s.reset(rank=r, size=size)
        out.append(s)
    return out


def one_step(samplers):
    """Every simulated rank takes its share of the next global batch and records it."""
    batch = samplers[0].global_batch_indices(0)
    shares = []
    for s in samplers:
        assert s.global_batch_indices(0) == batch
        shares.append(s.share_of(batch))
        s.record_global_batch()
    return batch, shares


# ---------------------------------------------------------------- the split

@pytest.mark.parametrize("n,g", [(25, 10), (30, 10), (7, 3), (5, 8), (1, 1), (100, 7)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_global_batches_do_not_depend_on_world_size(n, g, drop_last):
    reference = None
    for size in (1, 2, 3, 4, 5, 11):
        samplers = ranks(n, size, g, seed=3, drop_last=drop_last)
        batches = []
        while samplers[0].global_batches_left:
            batch, shares = one_step(samplers)
            assert len(batch) == g
            assert sorted(i for share in shares for i in share) == sorted(batch)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            batches.append(batch)
        if reference is None:
            reference = batches
        assert batches == reference
    perm = list(ElasticSampler(list(range(n)), seed=3))
    steps = n // g if drop_last else -(-n // g)
    assert len(reference) == steps
    # Consecutive slices of the epoch's permutation; padding wraps to its start.
    assert [i for b in reference for i in b] == [perm[p % n] for p in range(steps * g)]


def test_membership_changes_and_epoch_boundaries_keep_the_batch_sequence():
    """4 -> 2 -> 3 ranks across two epochs, with changes mid-epoch and at an epoch's end."""
    n, g = 25, 10
    solo = ranks(n, 1, g)[0]
    expected = []
    for epoch in range(3):
        solo.set_epoch(epoch)
        while solo.global_batches_left:
            expected.append(one_step([solo])[0])
    schedule = [4, 4, 4, 2, 2, 3, 3, 3, 3]   # the world size at each of the 9 steps
    samplers = ranks(n, 4, g)
    got, epoch = [], 0
    for size in schedule:
        if size != len(samplers):             # a newcomer loads the committed state; survivors reset
            sd = samplers[0].state_dict()
            samplers = [s for s in samplers[:size]]
            samplers += ranks(n, size, g, state=sd)[len(samplers):]
            for r, s in enumerate(samplers):
                s.reset(rank=r, size=size)
        if not samplers[0].global_batches_left:
            epoch += 1
            for s in samplers:
                s.set_epoch(epoch)
        got.append(one_step(samplers)[0])
    assert got == expected
    assert samplers[0].state_dict() == {"epoch": 2, "processed": 25, "seed": 0, "shuffle": True}


def test_state_stays_four_scalars_and_resumes():
    a = ranks(1000, 3, 64)[0]
    one_step([a])
    sd = a.state_dict()
    assert sd == {"epoch": 0, "processed": 64, "seed": 0, "shuffle": True}
    b = ranks(1000, 5, 64, state=sd)
    assert b[0].global_batch_indices(0) == a.global_batch_indices(0)
    assert b[0].global_batches_left == a.global_batches_left == 15


def test_iter_and_len_give_this_ranks_shares():
    samplers = ranks(25, 3, 10)
    per = [list(s) for s in samplers]
    assert [len(p) for p in per] == [len(s) for s in samplers] == [12, 9, 9]
    batches = [samplers[0].global_batch_indices(i) for i in range(3)]
    assert per[1] == [i for b in batches for i in b[1::3]]


def test_recording_rules():
    s = ranks(20, 2, 5)[0]
    with pytest.raises(RuntimeError, match="record_global_batch"):
        s.record_batch(0, 5)
    with pytest.raises(RuntimeError, match="record_global_batch"):
        s.record_indices([1, 2])
    plain = ElasticSampler(list(range(20)))
    with pytest.raises(RuntimeError, match="global_batch_size"):
        plain.record_global_batch()
    with pytest.raises(ValueError, match="global_batch_size"):
        list(plain.global_batches(None))
    with pytest.raises(IndexError):
        s.global_batch_indices(4)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError):
            ElasticSampler(list(range(20)), global_batch_size=bad)
    for _ in range(9):
        s.record_global_batch()           # capped at the end of the epoch
    assert s.processed_num == 20 and s.global_batches_left == 0


def test_forgetting_to_record_is_an_error():
    model = torch.nn.Linear(2, 1)
    opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    s = ElasticSampler(list(range(8)), global_batch_size=4)
    it = s.global_batches(opt)
    next(it)
    with pytest.raises(RuntimeError, match="record_global_batch"):
        next(it)


# ---------------------------------------------------------------- ElasticSampler robustness

class _Squares(torch.utils.data.Dataset):
    """A map-style dataset that is not a list: __len__ and __getitem__ only."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([float(i)]), torch.tensor([float(i * i)])


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 13, 64])
@pytest.mark.parametrize("size", [1, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_any_length_through_a_dataloader(n, size, drop_last):
    """Every rank gets the same number of samples (the DataLoader steps stay in lockstep),
    drop_last never repeats, padding covers everything, and datasets shorter than the
    world work both ways."""
    ds = _Squares(n)
    seen, lengths = [], set()
    for r in range(size):
        s = ElasticSampler(ds, seed=2, drop_last=drop_last)
        s.reset(rank=r, size=size)
        loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=s)
        xs = [int(v) for x, _ in loader for v in x.flatten().tolist()]
        lengths.add(len(xs))
        seen += xs
    assert len(lengths) == 1
    per = lengths.pop()
    if drop_last:
        assert per == n // size and len(seen) == len(set(seen))
    else:
        assert per == -(-n // size) and set(seen) == set(range(n))
        assert len(seen) - n < size               # padding: fewer repeats than ranks


@pytest.mark.parametrize("global_batch_size", [None, 4])
def test_state_is_o1_whatever_the_dataset_length(global_batch_size):
    import pickle
    sizes = []
    for n in (10, 10 ** 6):
        s = ElasticSampler(range(n), global_batch_size=global_batch_size)
        s.reset(rank=1, size=3)
        if global_batch_size:
            s.record_global_batch()
        else:
            s.record_batch(0, 4)
        sd = s.state_dict()
        assert set(sd) == {"epoch", "processed", "seed", "shuffle"}
        sizes.append(len(pickle.dumps(sd)))
    assert sizes[1] - sizes[0] <= 4 and sizes[1] < 100   # only the integers grow


@pytest.mark.parametrize("n,size_before,size_after", [(10, 4, 3), (9, 3, 2), (7, 2, 5)])
def test_epoch_boundary_crossed_during_a_membership_change(n, size_before, size_after):
    """The change lands after an epoch's last (padded) batch, before set_epoch(next):
    the finished epoch hands out nothing more, and the next one is split exactly once."""
    old = [ElasticSampler(list(range(n)), seed=5) for _ in range(size_before)]
    for r, s in enumerate(old):
        s.reset(rank=r, size=size_before)
        s.record_indices(list(s))              # the epoch's last step, padded
    sd = old[0].state_dict()
    assert sd["processed"] == n and sd["epoch"] == 0
    # Survivors reset; newcomers load the committed state; then the loop's set_epoch runs.
    new = old[:size_after] + [ElasticSampler(list(range(n))) for _ in range(size_after - size_before)]
    for r, s in enumerate(new):
        if r >= size_before:
            s.load_state_dict(sd)
        s.reset(rank=r, size=size_after)
        s.set_epoch(0)                         # resume epoch 0: nothing left
        assert len(s) == 0 and s.remaining == 0
    for s in new:
        s.set_epoch(1)
    got = [i for s in new for i in s]
    assert set(got) == set(range(n)) and len(got) - n < size_after
    assert len({len(s) for s in new}) == 1


def test_membership_change_mid_epoch_then_epoch_end_then_change_again():
    """4 ranks mid-epoch -> 2 ranks to the end of the epoch -> 3 ranks in the next one:
    each epoch trains every sample, and only its last step pads."""
    n = 23
    samplers = [ElasticSampler(list(range(n)), seed=8) for _ in range(4)]
    for r, s in enumerate(samplers):
        s.reset(rank=r, size=4)
    epoch0 = []
    for s in samplers:
        epoch0 += s.get_indices(0, 2)
        s.record_batch(0, 2)
    samplers = samplers[:2]
    for r, s in enumerate(samplers):
        s.reset(rank=r, size=2)
        items = list(s)
        epoch0 += items
        s.record_indices(items)
    assert set(epoch0) == set(range(n)) and len(epoch0) - n < 2
    sd = samplers[0].state_dict()
    samplers.append(ElasticSampler(list(range(n))))
    samplers[2].load_state_dict(sd)
    for r, s in enumerate(samplers):
        s.reset(rank=r, size=3)
        s.set_epoch(1)
    epoch1 = [i for s in samplers for i in s]
    assert set(epoch1) == set(range(n)) and len(epoch1) - n < 3
    assert epoch1 != epoch0[:len(epoch1)]      # a new permutation


# ---------------------------------------------------------------- the gradient

class FakeDistOpt:
    """Reduces nothing; stands for a DistributedOptimizer with the given op."""

    def __init__(self, op):
        self.op = op
        self.in_no_sync = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync += 1
        yield


def _data(n):
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), \
        torch.randn(n, 1, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("op", [Average, Sum])
@pytest.mark.parametrize("size,micro", [(1, None), (3, 2), (4, 1), (7, 3), (12, 2)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_weighted_micro_batches_give_the_global_mean_gradient(monkeypatch, op, size, micro,
                                                              reduction):
    """Reduce the simulated ranks' gradients with ``op``: the result is the mean over G."""
    x, y = _data(30)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    g = 10   # with 12 ranks, two get nothing and still take part
    monkeypatch.setattr(runtime, "size", lambda: size)
    full = torch.nn.functional.mse_loss(model(x[:g]), y[:g])   # sampler without shuffle
    expected = torch.autograd.grad(full, list(model.parameters()))
    total = [torch.zeros_like(p) for p in model.parameters()]
    samplers = ranks(30, size, g, shuffle=False)
    for s in samplers:
        opt = FakeDistOpt(op)
        model.zero_grad()
        it = s.global_batches(opt, micro_batch_size=micro)
        batch = next(it)
        assert batch.global_indices == list(range(g))
        for m in batch:
            xi, yi = x[m.indices], y[m.indices]
            loss = torch.nn.functional.mse_loss(model(xi), yi, reduction=reduction)
            m.backward(loss, reduction=reduction)
        assert opt.in_no_sync == max(0, len(batch) - 1)
        for t, p in zip(total, model.parameters()):
            if p.grad is not None:
                t += p.grad
    reduced = [t / size if op == Average else t for t in total]
    for a, b in zip(reduced, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_ddp_owner_learns_before_each_forward_whether_its_backward_reduces(monkeypatch):
    """torch's DDP decides at the forward pass: elastic.DDP (sync_backward) hears False
    before each micro-batch but the last, and True again once the batch is done or
    left early. The real DDP counts its launches in
    tests/test_torch_distributed.py::test_fp16_compression_hook_bucketing_and_overlap_across_a_change."""
    class Owner(FakeDistOpt):
        def __init__(self):
            super().__init__(Average)
            self.heard = []

        def sync_backward(self, sync):
            self.heard.append(sync)

    monkeypatch.setattr(runtime, "size", lambda: 2)
    owner = Owner()
    sampler = ElasticSampler(list(range(12)), global_batch_size=6)
    batches = sampler.global_batches(owner, micro_batch_size=1)
    seen = []
    for micro in next(batches):
        seen.append((owner.heard[-1], micro.last))
    assert seen == [(False, False), (False, False), (True, True)]
    assert owner.heard[-1] is True
    sampler.record_global_batch()
    for _micro in next(batches):
        assert owner.heard[-1] is False
        break                                    # left early: reset as the loop ends
    assert owner.heard[-1] is True


def test_plain_optimizer_only_on_its_own(monkeypatch):
    model = torch.nn.Linear(2, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    s = ElasticSampler(list(range(8)), global_batch_size=4)
    assert next(s.global_batches(plain)).micro_batches[0].weight == 1.0
    monkeypatch.setattr(runtime, "size", lambda: 2)
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        next(ElasticSampler(list(range(8)), global_batch_size=4).global_batches(plain))
    with pytest.raises(ValueError, match="op=Average or op=Sum"):
        next(s.global_batches(FakeDistOpt(elastic.Max)))


def test_standalone_matches_a_plain_full_batch_step():
    """Size 1, micro-batches of 3 through a real DistributedOptimizer: the same update
    as one plain step on the whole global batch."""
    x, y = _data(24)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 1)).double()
    ref.load_state_dict(model.state_dict())
    opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(list(range(24)), global_batch_size=8, seed=4)
    steps = 0
    for batch in sampler.global_batches(opt, micro_batch_size=3):
        opt.zero_grad()
        for m in batch:
            m.backward(torch.nn.functional.mse_loss(model(x[m.indices]), y[m.indices]))
        opt.step()
        sampler.record_global_batch()
        ref_opt.zero_grad()
        idx = batch.global_indices
        torch.nn.functional.mse_loss(ref(x[idx]), y[idx]).backward()
        ref_opt.step()
        steps += 1
    assert steps == 3
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_no_sync_after_the_allreduce_launched_is_an_error(monkeypatch):
    from support.optimizer_fakes import FakeComm, FakeWorker
    FakeComm(monkeypatch, FakeWorker())
    model = torch.nn.Linear(3, 1)
    opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(2, 3)
    with opt.no_sync():
        model(x).sum().backward()       # accumulates, launches nothing
    model(x).sum().backward()           # launches the allreduce of the sum
    with pytest.raises(RuntimeError, match="no_sync"):
        with opt.no_sync():
            model(x).sum().backward()


# ---------------------------------------------------------------- real gloo, three ranks

GLOO_WORKER = textwrap.dedent('''
    import json, os, sys
    import torch
    import elastic

    def data():
        g = torch.Generator().manual_seed(11)
        return (torch.randn(16, 3, generator=g, dtype=torch.float64),
                torch.randn(16, 1, generator=g, dtype=torch.float64))

    def train(G, micro, op, steps=4, dist=True):
        x, y = data()
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                                    torch.nn.Linear(5, 1)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
        if dist:
            opt = elastic.DistributedOptimizer(opt, op=getattr(elastic, op), bucket_cap_mb=1e-4)
        sampler = elastic.ElasticSampler(list(range(16)), seed=2, global_batch_size=G)
        shares, done = [], 0
        while done < steps:
            for batch in sampler.global_batches(opt, micro_batch_size=micro):
                opt.zero_grad()
                for m in batch:
                    m.backward(torch.nn.functional.mse_loss(model(x[m.indices]), y[m.indices]))
                opt.step()
                sampler.record_global_batch()
                shares.append(len(batch.indices))
                done += 1
                if done == steps:
                    break
            else:
                sampler.set_epoch(sampler.epoch + 1)
        return [p.detach().flatten().tolist() for p in model.parameters()], shares

    CONFIGS = {"empty_share": (2, 1, "Average"), "uneven": (7, 2, "Average"),
               "sum": (7, 1, "Sum"), "whole_share": (8, None, "Average")}

    if __name__ == "__main__":
        elastic.init()
        out = {k: train(*v) for k, v in CONFIGS.items()}
        with open(os.path.join(os.environ["OUT_DIR"], f"rank{elastic.rank()}.json"), "w") as f:
            json.dump(out, f)
''')


@slow
def test_gloo_uneven_and_empty_shares_match_one_process(tmp_path):
    """3 ranks: shares of 1, 1 and 0 samples, or 3/2/2 in micro-batches of 2: the update
    equals one process training the whole global batch."""
    script = tmp_path / "worker.py"
    script.write_text(GLOO_WORKER)
    check_ok(run_workers(script, 3, timeout=120, extra_env={"OUT_DIR": str(tmp_path)}))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    spec = importlib.util.spec_from_file_location("gb_gloo_worker", script)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    for name, (g, _micro, op) in worker.CONFIGS.items():
        expected, _ = worker.train(g, g, op, dist=False)   # one process, one micro-batch
        for r in range(3):
            assert results[r][name][0] == results[0][name][0], (name, r)
        got = results[0][name][0]
        for a, b in zip(got, expected):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-12, atol=1e-13)
    assert results[2]["empty_share"][1] == [0, 0, 0, 0]
    assert [results[r]["uneven"][1][0] for r in range(3)] == [3, 2, 2]


# ---------------------------------------------------------------- real jobs

THIRD_HOST = socket.gethostname()
GB_WORKLOAD = REPO / "tests" / "workloads" / "gb_train.py"
STEPS = 9          # 3 epochs of 25 samples in global batches of 10 (the last one padded)


def run_job(tmp_path, elastic_schedule):
    """A fixed 4-worker job, or one that goes 4 -> 2 (at step 3) -> 3 (at step 5).
    Both train a global-batch model and an ordinary model side by side."""
    env = {"GB_STEPS": str(STEPS), "GB_HOLD": "3,5" if elastic_schedule else ""}
    if not elastic_schedule:
        job = Job(tmp_path, ["-np", "4", "-H", "localhost:2,127.0.0.1:2"], env=env,
                  script=GB_WORKLOAD)
        assert job.run() == 0, job.output()[-4000:]
        return job
    job = Job(tmp_path, ["-np", "4", "--min-np", "2", "--max-np", "4"],
              hosts=["localhost:2", "127.0.0.1:2"], env=env, script=GB_WORKLOAD).start()
    job.wait_step(3)
    job.set_hosts(["127.0.0.1:2"])                      # 4 -> 2 at the commit of step 3
    job.wait_step(4, size=2)
    job.wait_step(5)
    job.set_hosts(["127.0.0.1:2", f"{THIRD_HOST}:1"])    # 2 -> 3 at the commit of step 5
    job.wait_step(6, size=3)
    assert job.finish() == 0, job.output()[-4000:]
    return job


def finals(job):
    out = [json.loads(p.read_text()) for p in sorted(job.out.glob("final.*.json"))]
    assert len(out) == out[0]["size"]
    for f in out[1:]:
        assert f["params"] == out[0]["params"]   # every rank ends bitwise equal
    return out[0]


def rel_error(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def gb_jobs(tmp_path_factory):
    fixed = run_job(tmp_path_factory.mktemp("gb_fixed"), elastic_schedule=False)
    changed = run_job(tmp_path_factory.mktemp("gb_elastic"), elastic_schedule=True)
    return fixed, changed


@slow
def test_world_4_2_3_matches_a_fixed_4_worker_run(gb_jobs):
    fixed, changed = gb_jobs
    assert sizes_in_order(fixed.steps()) == [4]
    assert sizes_in_order(changed.steps()) == [4, 2, 3]
    by_step = {r["step"]: r["size"] for r in changed.steps()}
    assert [by_step[s] for s in range(1, STEPS + 1)] == [4, 4, 4, 2, 2, 3, 3, 3, 3]
    a, b = finals(changed), finals(fixed)
    assert a["step"] == b["step"] == STEPS and a["size"] == 3 and b["size"] == 4
    # Each step trained the same global batch in both runs.
    assert a["global_batches"] == b["global_batches"]
    err = rel_error(a["params"]["global"], b["params"]["global"])
    assert err < 1e-5, err
    # Not trivially equal: training moved the parameters.
    assert rel_error(b["params"]["global"], b["initial"]) > 1e-2


@slow
def test_negative_control_ordinary_mode_differs(gb_jobs):
    fixed, changed = gb_jobs
    a, b = finals(changed), finals(fixed)
    err = rel_error(a["params"]["ordinary"], b["params"]["ordinary"])
    assert err > 1e-3, err
