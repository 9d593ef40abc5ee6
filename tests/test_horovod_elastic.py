"""Behaviours of Horovod's elastic unit tests (test/single/test_torch_elastic.py), written
here: TorchState commit/restore/sync, ElasticSampler progress and len(), plus the handler
registry and Horovod's sampler state dicts."""

import copy
import os
import random
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import elastic.torch as hvd
from elastic.checkpoint.checkpointer import Checkpointer
from elastic.state import handlers

sys.path.insert(0, os.path.dirname(__file__))
from support.harness import check_ok, run_workers  # noqa: E402


class ListDataset(Dataset):
    def __init__(self, data):
        self.data = data

    def __getitem__(self, idx):
        return self.data[idx]

    def __len__(self):
        return len(self.data)


def _linear(v):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.load_state_dict({"0.weight": torch.full((2, 2), v), "0.bias": torch.full((2,), v)})
    return model


# -- TorchState --------------------------------------------------------------------------
def test_state_commit_restore_round_trip():
    hvd.init()
    model1 = _linear(1.0)
    model2 = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model2.load_state_dict({"0.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                            "0.bias": torch.zeros(2)})
    optimizer = torch.optim.SGD(model1.parameters(), lr=0.001 * hvd.size())
    state = hvd.elastic.TorchState(model1, optimizer, batch=20, epoch=10)
    state.sync()
    weights1 = copy.deepcopy(model1.state_dict())
    assert all(torch.equal(w, torch.ones_like(w)) for w in state.model.state_dict().values())
    assert (state.batch, state.epoch) == (20, 10)
    # Partly modify, then restore: back to the sync's snapshot.
    model1.load_state_dict(model2.state_dict())
    state.batch, state.epoch = 21, 11
    state.restore()
    for w1, w2 in zip(model1.state_dict().values(), weights1.values()):
        assert torch.equal(w1, w2)
    assert (state.batch, state.epoch) == (20, 10)
    # Partly modify, then commit: restore now lands on the modified values.
    model1.load_state_dict(model2.state_dict())
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    for w1, w2 in zip(model1.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(w1, w2)
    assert (state.batch, state.epoch) == (21, 11)


def test_sampler_progress_restore_and_len_after_sync():
    hvd.init()
    batch_size, per_worker = 2, 8
    dataset = ListDataset(list(range(per_worker * hvd.size())))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    assert state.sampler.epoch == 0 and state.sampler.processed_num == 0
    total = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch_idx, _batch in enumerate(loader):
            sampler.record_batch(batch_idx, batch_size)
            assert sampler.processed_num == batch_size * (batch_idx + 1)
            total += 1
    assert total == per_worker // batch_size * 2
    # Without set_epoch the progress stays and the loader repeats the same share.
    total = 0
    for _ in loader:
        assert sampler.processed_num == len(sampler)
        total += 1
    assert total == per_worker // batch_size
    # Part of an epoch, commit, more, restore.
    sampler.set_epoch(2)
    assert sampler.processed_num == 0
    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    committed = sampler.processed_num
    assert committed == 2 * batch_size
    state.commit()
    sampler.record_batch(2, batch_size)
    sampler.record_batch(3, batch_size)
    assert sampler.processed_num == 4 * batch_size
    state.restore()
    assert sampler.processed_num == committed
    # After record_batch, commit and sync, the rest is split again: len() shrinks.
    sampler.record_batch(2, batch_size)
    assert sampler.processed_num == 3 * batch_size
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * batch_size * hvd.size()
    assert len(sampler) == batch_size
    assert sum(1 for _ in loader) == 1
    sampler.set_epoch(3)
    assert len(sampler) == per_worker
    assert sum(1 for _ in loader) == per_worker // batch_size


def test_sampler_has_horovods_attributes():
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    sampler.reset(rank=1, size=3)
    assert (sampler.rank, sampler.num_replicas, sampler.size) == (1, 3, 3)
    assert sampler.num_samples == len(sampler) == 4 and sampler.total_size == 12
    assert list(sampler) == sampler.indices == [1, 4, 7, 0]
    sampler.record_batch(0, 2)
    assert sampler.processed_num == 6 and sampler.processed_indices == set(range(6))
    assert sampler.remaining_indices == list(range(10))   # as of the last reset, as in Horovod
    sampler.reset(rank=0, size=2)
    assert sampler.remaining_indices == [6, 7, 8, 9] and len(sampler) == 2
    assert sampler.dataset == list(range(10)) and sampler.seed == 0 and not sampler.shuffle


def _horovod_order(n, seed, epoch):
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    return order


def test_sampler_loads_horovods_state_dicts():
    n = 20
    sampler = hvd.elastic.ElasticSampler(list(range(n)), shuffle=True, seed=4)
    sampler.load_state_dict({"epoch": 3, "processed_num": 8})   # Horovod's current format
    order = _horovod_order(n, 4, 3)
    assert sampler.epoch == 3 and sampler.processed_num == 8
    assert sampler.processed_indices == set(order[:8])        # exactly what Horovod trained
    assert list(sampler) == order[8:]
    again = hvd.elastic.ElasticSampler(list(range(n)), shuffle=True, seed=4)
    again.load_state_dict(sampler.state_dict())                 # and it round-trips
    assert list(again) == order[8:]
    # Horovod's older format: a set of processed indices, not necessarily a prefix.
    done = {1, 5, 17}
    sampler.load_state_dict({"epoch": 1, "processed_indices": done})
    assert sampler.processed_indices == done
    assert sorted(sampler) == sorted(set(range(n)) - done)
    sampler.set_epoch(2)   # a new epoch starts with nothing processed, in Horovod's order
    assert list(sampler) == _horovod_order(n, 4, 2)
    with pytest.raises(ValueError, match="sampler state"):
        sampler.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="outside"):
        sampler.load_state_dict({"epoch": 1, "processed_indices": {99}})


# -- objects under any keyword: committed and restored in place -----------------------------
def _gan():
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    return gen, disc, torch.optim.Adam(gen.parameters(), lr=0.1), \
        torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)


def _gan_step(gen, disc, opt_g, opt_d):
    x = torch.randn(4, 3)
    for opt in (opt_g, opt_d):
        opt.zero_grad()
    disc(gen(x)).sum().backward()
    opt_g.step()
    opt_d.step()


def test_modules_and_optimizers_under_any_keyword_restore_in_place():
    gen, disc, opt_g, opt_d = _gan()
    sched = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.5)
    state = hvd.elastic.TorchState(generator=gen, discriminator=disc, opt_g=opt_g, opt_d=opt_d,
                                   sched=sched, steps=0)
    _gan_step(gen, disc, opt_g, opt_d)
    state.commit()
    committed = [p.detach().clone() for p in list(gen.parameters()) + list(disc.parameters())]
    committed_opt = copy.deepcopy(opt_d.state_dict())
    for _ in range(2):
        _gan_step(gen, disc, opt_g, opt_d)
        sched.step()
    state.steps = 2
    state.restore()
    # The very same objects, rolled back.
    assert state.generator is gen and state.opt_g is opt_g and state.sched is sched
    live = list(gen.parameters()) + list(disc.parameters())
    assert all(torch.equal(a, b) for a, b in zip(live, committed))
    assert torch.equal(opt_d.state_dict()["state"][0]["momentum_buffer"],
                       committed_opt["state"][0]["momentum_buffer"])
    assert sched.last_epoch == 0 and opt_g.param_groups[0]["lr"] == 0.1 and state.steps == 0
    # The optimizers still update the live parameters.
    _gan_step(gen, disc, opt_g, opt_d)
    assert not all(torch.equal(a, b) for a, b in zip(live, committed))
    # Reassigning an attribute takes the new object from the next commit on.
    other = torch.nn.Linear(3, 3)
    state.generator = other
    state.commit()
    before = other.weight.detach().clone()
    with torch.no_grad():
        other.weight.add_(1.0)
    state.restore()
    assert torch.equal(other.weight, before)


class Counter:
    """A user type with its own state, not picklable by value on purpose."""

    def __init__(self):
        self.value = torch.zeros(2)
        self.lock = __import__("threading").Lock()


class CounterHandler(handlers.Handler):
    def capture(self, obj):
        return {"value": obj.value}

    def apply(self, obj, tree):
        obj.value.copy_(tree["value"])


@pytest.fixture
def registry():
    saved = handlers.get_handler_registry()
    yield handlers
    handlers.set_handler_registry(saved)


def test_user_handlers_commit_and_restore_in_place(registry):
    registry.register_handler(Counter, CounterHandler())
    counter = Counter()
    state = hvd.elastic.TorchState(counter=counter)
    counter.value += 3
    state.commit()
    counter.value += 1
    state.restore()
    assert state.counter is counter and torch.equal(counter.value, torch.full((2,), 3.0))
    with pytest.raises(TypeError):
        registry.register_handler(Counter, object())


def test_horovod_style_handler_registry(registry):
    calls = []

    class HorovodCounterHandler(handlers.HorovodHandler):
        def __init__(self, value):
            super().__init__(value)
            self.saved = value.value.clone()

        def save(self):
            calls.append("save")
            self.saved = self.value.value.clone()

        def restore(self):
            calls.append("restore")
            self.value.value.copy_(self.saved)

        def sync(self):
            calls.append("sync")

    registry.set_handler_registry(registry.get_handler_registry()
                                  + [(Counter, HorovodCounterHandler)])
    counter = Counter()
    state = hvd.elastic.TorchState(counter=counter)
    state.sync()
    counter.value += 2
    state.commit()
    counter.value += 5
    state.restore()
    assert torch.equal(counter.value, torch.full((2,), 2.0))
    assert calls[0] == "save" and "sync" in calls and calls[-1] == "restore"


def test_checkpoint_is_an_ordinary_keyword(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTIC_CHECKPOINT_DIR", raising=False)
    state = hvd.elastic.TorchState(checkpoint={"best": 1.0})
    assert state.checkpoint == {"best": 1.0} and state.checkpointer is None
    state.commit()
    state.checkpoint["best"] = 0.5
    state.restore()
    assert state.checkpoint == {"best": 1.0}
    ck = Checkpointer(tmp_path)
    assert hvd.elastic.TorchState(elastic_checkpoint=ck).checkpointer is ck
    ck.close()


# -- real gloo: sync lands in the live objects ---------------------------------------------
WORKER = textwrap.dedent('''
    import os
    import torch
    import elastic.torch as hvd

    hvd.init()
    rank = hvd.rank()
    v = 1.0 if rank == 0 else 2.0
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.load_state_dict({"0.weight": torch.full((2, 2), v), "0.bias": torch.full((2,), v)})
    torch.manual_seed(rank)
    gen, disc = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:   # only rank 0 has optimizer state
        disc(gen(torch.randn(2, 3))).sum().backward()
        opt_d.step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001 * hvd.size())
    state = hvd.elastic.TorchState(model, optimizer, generator=gen, discriminator=disc,
                                   opt_d=opt_d, batch=20 + rank, epoch=10 + rank)
    state.sync()
    assert state.model is model and state.generator is gen and state.opt_d is opt_d
    assert all(torch.equal(w, torch.ones_like(w)) for w in model.state_dict().values())
    assert (state.batch, state.epoch) == (20, 10)
    digest = hvd.allgather_object([p.detach().clone() for p in
                                   list(gen.parameters()) + list(disc.parameters())]
                                  + [opt_d.state_dict()["state"][0]["momentum_buffer"]])
    assert all(all(torch.equal(a, b) for a, b in zip(digest[0], d)) for d in digest)
    # opt_d still drives the live discriminator
    before = disc.weight.detach().clone()
    opt_d.zero_grad()
    disc(gen(torch.ones(2, 3))).sum().backward()
    opt_d.step()
    assert not torch.equal(before, disc.weight)
    open(os.path.join(os.environ["OUT_DIR"], f"ok{rank}"), "w").close()
''')


@pytest.mark.slow
def test_gloo_sync_lands_in_the_live_objects(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    check_ok(run_workers(script, 2, timeout=180, extra_env={"OUT_DIR": str(tmp_path)}))
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
