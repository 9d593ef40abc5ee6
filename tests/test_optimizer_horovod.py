"""DistributedOptimizer with Horovod's full signature, and gradients as bucket views."""

import os
import sys
import textwrap

import pytest
import torch

from elastic.exceptions import WorkersDepartedError
from elastic.training.optimizer import Compression, DistributedOptimizer
from elastic.worker import collectives

sys.path.insert(0, os.path.dirname(__file__))
from support.harness import check_ok, run_workers  # noqa: E402
from support.optimizer_fakes import FakeComm, FakeWorker, batch_of, tiny_model, train_steps  # noqa: E402


def _sgd(model, **kw):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kw)


def _flats(dopt):
    return dopt.bucket_flats


def _is_view_of(grad, flats):
    ptr = grad.untyped_storage().data_ptr()
    return any(ptr == f.untyped_storage().data_ptr() for f in flats)


# -- the signature --------------------------------------------------------------------------
def test_wrapper_is_an_instance_of_the_wrapped_class():
    model = tiny_model()
    for make in (lambda: torch.optim.SGD(model.parameters(), lr=0.1),
                 lambda: torch.optim.Adam(model.parameters(), lr=0.1)):
        inner = make()
        dopt = DistributedOptimizer(inner)
        assert isinstance(dopt, type(inner)) and isinstance(dopt, torch.optim.Optimizer)
        assert type(dopt).__name__ == type(inner).__name__
        assert type(DistributedOptimizer(make())) is type(dopt)  # one class per optimizer class
    with pytest.raises(ValueError, match="already"):
        DistributedOptimizer(dopt)


def test_horovod_positional_order_and_bucket_cap_keyword_only():
    model = tiny_model()
    # optimizer, named_parameters, compression, backward_passes_per_step, op,
    # gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set
    dopt = DistributedOptimizer(_sgd(model), model.named_parameters(), Compression.none, 2,
                                collectives.Average, 2.0, 0, None, True, None)
    assert dopt.backward_passes_per_step == 2 and dopt.gradient_predivide_factor == 2.0
    assert dopt.sparse_as_dense is True and dopt.process_set is None
    with pytest.raises(TypeError):
        DistributedOptimizer(_sgd(model), None, Compression.none, 1, collectives.Average, 1.0,
                             0, None, False, None, 5)
    assert DistributedOptimizer(_sgd(model), bucket_cap_mb=1e-5).bucket_cap_bytes == 10
    with pytest.raises(ValueError, match="op != Average"):
        DistributedOptimizer(_sgd(model), op=collectives.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="process_set"):
        DistributedOptimizer(_sgd(model), process_set=object())

    class GlobalSet:
        process_set_id = 0
    DistributedOptimizer(_sgd(model), process_set=GlobalSet())


def test_groups_are_validated_and_fix_the_buckets(monkeypatch):
    model = tiny_model()
    params = list(model.parameters())
    for bad in (-1, "two", [[torch.zeros(2)]], [[params[0]], [params[0]]], [[1.0]]):
        with pytest.raises(ValueError):
            DistributedOptimizer(_sgd(model), groups=bad)
    comm = FakeComm(monkeypatch, FakeWorker())
    dopt = DistributedOptimizer(_sgd(model), groups=2, bucket_cap_mb=1e-6)
    train_steps(model, dopt, steps=1)
    assert dopt.bucket_count == 2
    dopt = DistributedOptimizer(_sgd(model), num_groups=3)   # Horovod's older name
    train_steps(model, dopt, steps=1)
    assert dopt.bucket_count == 3
    # Listed groups travel together; the rest go in size-capped buckets.
    dopt = DistributedOptimizer(_sgd(model), groups=[[params[0], params[3]]], bucket_cap_mb=1e-6)
    comm.launched.clear()
    train_steps(model, dopt, steps=1)
    assert dopt.bucket_count == 3
    assert sorted(t.numel() for t in comm.launched) == sorted(
        [params[0].numel() + params[3].numel(), params[1].numel(), params[2].numel()])


def test_set_backward_passes_per_step():
    model = tiny_model()
    dopt = DistributedOptimizer(_sgd(model))
    dopt.set_backward_passes_per_step(3)
    assert dopt.backward_passes_per_step == 3
    train_steps(model, dopt, steps=2, k=3)  # three passes before each step are no error
    with pytest.raises(ValueError):
        dopt.set_backward_passes_per_step(0)


def test_predivide_factor_gives_the_average(monkeypatch):
    FakeComm(monkeypatch, FakeWorker())
    a, b = tiny_model(), tiny_model()
    ref = train_steps(a, DistributedOptimizer(_sgd(a)), steps=3)
    got = train_steps(b, DistributedOptimizer(_sgd(b), gradient_predivide_factor=4.0), steps=3)
    for x, y in zip(ref, got):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


# -- gradients as bucket views ---------------------------------------------------------------
def test_gradients_are_views_into_the_buckets_without_copies(monkeypatch):
    comm = FakeComm(monkeypatch, FakeWorker())
    model = tiny_model()
    dopt = DistributedOptimizer(_sgd(model), bucket_cap_mb=1e-4)
    train_steps(model, dopt, steps=1)
    flats = _flats(dopt)
    assert len(flats) > 1 and all(_is_view_of(p.grad, flats) for p in model.parameters())
    grads = [p.grad for p in model.parameters()]
    # Another step: the same views, and the allreduce ran on the very buffers backward wrote.
    comm.launched.clear()
    x, y = batch_of(3)
    dopt.zero_grad()
    assert not any(g.any() for g in grads)
    ((model(x) - y) ** 2).mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    dopt.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(any(t is f for f in flats) for t in comm.launched)
    for p, g in zip(model.parameters(), local):
        assert torch.equal(p.grad, 2 * g)   # FakeComm: (g + 3g) / 2


def test_module_zero_grad_and_new_round_rebuild_the_views(monkeypatch):
    worker = FakeWorker()
    FakeComm(monkeypatch, worker)
    model = tiny_model()
    dopt = DistributedOptimizer(_sgd(model))
    train_steps(model, dopt, steps=1)
    model.zero_grad()   # gradients None: backward makes new ones, copied in once
    x, y = batch_of(5)
    ((model(x) - y) ** 2).mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    dopt.step()
    assert all(_is_view_of(p.grad, _flats(dopt)) for p in model.parameters())
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), local))
    old = _flats(dopt)
    worker.round_id = 2   # a membership change: new buffers, gradients follow them
    dopt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    dopt.step()
    new = _flats(dopt)
    assert all(n is not o for n, o in zip(new, old))
    assert all(_is_view_of(p.grad, new) and not _is_view_of(p.grad, old)
               for p in model.parameters())
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), local))


def test_failed_step_releases_the_views(monkeypatch):
    comm = FakeComm(monkeypatch, FakeWorker())
    model = tiny_model()
    dopt = DistributedOptimizer(_sgd(model))
    train_steps(model, dopt, steps=1)
    comm.fail = True
    x, y = batch_of(1)
    dopt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(WorkersDepartedError):
        dopt.step()
    # Abandoned work may still write the old buffer: no gradient may point into it.
    assert all(p.grad is None for p in model.parameters())
    comm.fail = False
    train_steps(model, dopt, steps=1)
    assert all(_is_view_of(p.grad, _flats(dopt)) for p in model.parameters())


def test_freezing_a_layer_later_leaves_it_alone(monkeypatch):
    FakeComm(monkeypatch, FakeWorker())
    model = tiny_model()
    dopt = DistributedOptimizer(_sgd(model, weight_decay=0.1))
    train_steps(model, dopt, steps=2)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    train_steps(model, dopt, steps=2)
    assert frozen.grad is None and torch.equal(frozen, before)
    assert all(_is_view_of(p.grad, _flats(dopt)) for p in model.parameters() if p.requires_grad)


# -- sparse gradients ----------------------------------------------------------------------
class _Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 3, sparse=True)
        self.fc = torch.nn.Linear(3, 1)

    def forward(self, idx):
        return self.fc(self.emb(idx)).sum()


def _sparse_run(dopt_kwargs, steps=3, fake=None):
    model = _Bag()
    opts = [torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.1),
            torch.optim.SGD(model.fc.parameters(), lr=0.1)]
    if dopt_kwargs is not None:
        opts = [DistributedOptimizer(o, **dopt_kwargs) for o in opts]
    seen = []
    for step in range(steps):
        for o in opts:
            o.zero_grad()
        model(torch.tensor([step, step + 1, 7])).backward()
        for o in opts:
            o.step()
        seen.append(model.emb.weight.grad.is_sparse)
    return model, seen


def test_sparse_gradients_come_back_sparse(monkeypatch):
    ref, _ = _sparse_run(None)
    got, seen = _sparse_run({})            # standalone: exactly the plain optimizers
    assert all(seen)
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.equal(a, b)
    FakeComm(monkeypatch, FakeWorker())    # reduced: still sparse for SparseAdam
    model, seen = _sparse_run({})
    assert all(seen)
    ref, _ = _sparse_run({"sparse_as_dense": True})
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


# -- real gloo: equal to a reference allreduce -----------------------------------------------
WORKER = textwrap.dedent('''
    import os
    import torch
    import elastic
    from elastic.training.optimizer import DistributedOptimizer

    elastic.init()
    rank, size = elastic.rank(), elastic.size()
    out = {}
    for name, kw in {"views": {}, "predivide": {"gradient_predivide_factor": 3.0},
                     "groups": {"groups": 3}}.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), **kw)
        got = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(4, 8, generator=g)
            dopt.zero_grad()
            # autograd.grad leaves p.grad alone: the local gradients, before any reduction
            local = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
            model(x).pow(2).sum().backward()
            dopt.step()
            got.append({"local": local, "reduced": [p.grad.clone() for p in model.parameters()],
                        "views": all(p.grad.untyped_storage().data_ptr() in
                                     {f.untyped_storage().data_ptr() for f in dopt.bucket_flats}
                                     for p in model.parameters())})
        out[name] = got
    torch.save(out, os.path.join(os.environ["OUT_DIR"], f"rank{rank}.pt"))
''')


@pytest.mark.slow
def test_gloo_reduced_gradients_equal_a_reference_average(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    n = 3
    check_ok(run_workers(script, n, timeout=240, extra_env={"OUT_DIR": str(tmp_path)}))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    for name in ("views", "predivide", "groups"):
        for step in range(3):
            expected = [sum(r[name][step]["local"][i] for r in ranks) / n
                        for i in range(len(ranks[0][name][step]["local"]))]
            for r in ranks:
                assert r[name][step]["views"], name
                for got, want in zip(r[name][step]["reduced"], expected):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_too_many_backward_passes_raise_horovods_assertion_error_from_backward():
    model = tiny_model()
    dopt = DistributedOptimizer(_sgd(model), backward_passes_per_step=2)
    x, y = batch_of(0)
    for _ in range(2):
        ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step=3"):
        ((model(x) - y) ** 2).mean().backward()
    dopt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    dopt.step()                                   # usable again after zero_grad()
