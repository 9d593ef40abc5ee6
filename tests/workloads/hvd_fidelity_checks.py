"""More of Horovod's PyTorch behaviours (issue 34), run by hvd_ops_suite.py in the same job.

Written here after what Horovod's op and optimizer tests check (not copied):
named async ops issued in different orders on different ranks (the duplicate-
name pattern), Horovod's gradients of allgather, broadcast and reducescatter,
its error types, sparse handles, broadcast_optimizer_state of a fresh
optimizer, DistributedOptimizer's names, step() warning and process sets.
Every check runs on every rank; an error is expected on every rank.
"""

import warnings

import torch
from job_helpers import raises, same

import elastic.torch as hvd

CHECKS = {}
HOROVOD_NAMES_ATTRIBUTE = "_parameter_names"     # what Horovod scripts read


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# -- named async ops, matched by name ------------------------------------------------------
def _rank0_first_then_the_others(issue, expect):
    """Horovod's duplicate-name test: rank 0 issues a named op and a duplicate, every
    rank meets at a collective, then the other ranks issue theirs and a duplicate."""
    r = hvd.rank()
    handles = []
    if r == 0:
        handles.append(issue("dup"))
        raises(ValueError, issue, "dup")
    same(hvd.allreduce(torch.ones(1), name="dup_sync1", op=hvd.Sum),
         torch.full((1,), float(hvd.size())))
    if r > 0:
        handles.append(issue("dup"))
        raises(ValueError, issue, "dup")
    same(hvd.allreduce(torch.ones(1), name="dup_sync2", op=hvd.Sum),
         torch.full((1,), float(hvd.size())))
    (out,) = [hvd.synchronize(h) for h in handles]
    for got, want in zip(out, expect) if isinstance(out, tuple) else [(out, expect)]:
        same(got, want)
    hvd.synchronize(issue("dup"))        # the name is free again on every rank


@check
def duplicate_names_raise_on_each_rank_and_the_job_goes_on():
    r, n = hvd.rank(), hvd.size()
    total = float(n * (n + 1) // 2)
    _rank0_first_then_the_others(
        lambda name: hvd.allreduce_async(torch.ones(5) * (r + 1), name=name, op=hvd.Sum),
        torch.full((5,), total))
    _rank0_first_then_the_others(
        lambda name: hvd.allgather_async(torch.tensor([r]), name=name), torch.arange(n))
    _rank0_first_then_the_others(
        lambda name: hvd.broadcast_async(torch.ones(3) * r, root_rank=n - 1, name=name),
        torch.full((3,), float(n - 1)))
    _rank0_first_then_the_others(
        lambda name: hvd.reducescatter_async(torch.ones(n, 2) * (r + 1), name=name, op=hvd.Sum),
        torch.full((1, 2), total))
    _rank0_first_then_the_others(
        lambda name: hvd.alltoall_async(torch.arange(n) + 10 * r, name=name),
        (torch.arange(n) * 10 + r, torch.ones(n, dtype=torch.int32)))


@check
def named_async_ops_match_by_name_in_any_order():
    r, n = hvd.rank(), hvd.size()
    a, b = torch.ones(3) * (r + 1), torch.ones(4) * (r + 1)
    if r % 2 == 0:
        ha = hvd.allreduce_async(a, name="order_a", op=hvd.Sum)
        hb = hvd.allgather_async(b, name="order_b")
    else:
        hb = hvd.allgather_async(b, name="order_b")
        ha = hvd.allreduce_async(a, name="order_a", op=hvd.Sum)
    assert hvd.poll(ha) in (True, False)
    same(hvd.synchronize(hb), torch.cat([torch.ones(4) * (k + 1) for k in range(n)]))
    same(hvd.synchronize(ha), torch.full((3,), float(n * (n + 1) // 2)))


@check
def waiting_for_an_op_no_peer_issued_raises_everywhere():
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        handle = hvd.allreduce_async(torch.ones(2), name="never_issued_elsewhere")
        e = raises(hvd.CollectiveMismatchError, hvd.synchronize, handle)
    else:
        e = raises(hvd.CollectiveMismatchError, hvd.allreduce, torch.ones(2), name="other")
    assert "have not issued" in str(e), e
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n)))
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="never_issued_elsewhere"))


# -- Horovod's gradients -----------------------------------------------------------------
@check
def allgather_gradients_average_then_slice():
    r, n = hvd.rank(), hvd.size()
    sizes = [3, 2, 7, 4, 6][:n]
    mean = (n + 1) / 2                  # the average of (rank + 1) over the ranks
    for dtype, dim in [(torch.float32, 1), (torch.float64, 2), (torch.float32, 3)]:
        tail = [5] * (dim - 1)
        grad_ys = torch.cat([torch.ones([s] + tail, dtype=dtype) * (k + 1)
                             for k, s in enumerate(sizes)]) * (r + 1)
        t = torch.ones([sizes[r]] + tail, dtype=dtype, requires_grad=True)
        hvd.allgather(t).backward(grad_ys)
        same(t.grad, torch.ones_like(t) * (r + 1) * mean)
        ts = [torch.ones([sizes[r]] + tail, dtype=dtype, requires_grad=True) for _ in range(3)]
        for g in hvd.grouped_allgather(ts):        # one backward per output, as Horovod's test
            g.backward(grad_ys)
        for t in ts:
            same(t.grad, torch.ones_like(t) * (r + 1) * mean)


@check
def broadcast_gradient_is_the_average_on_the_root():
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        t = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
        hvd.broadcast(t, root).backward(torch.ones(4, 3, dtype=torch.float64) * (r + 1))
        same(t.grad, torch.ones_like(t) * ((n + 1) / 2 if r == root else 0.0))


@check
def reducescatter_gradients_scale_with_the_op():
    r, n = hvd.rank(), hvd.size()
    blocks = torch.cat([torch.full((4, 3), float(k + 1), dtype=torch.float64)
                        for k in range(n)])              # rank k sent (k + 1) back
    for op, scale in ((hvd.Sum, n), (hvd.Average, 1)):
        t = torch.ones(4 * n, 3, dtype=torch.float64, requires_grad=True)
        out = hvd.reducescatter(t, op=op)
        out.backward(torch.ones_like(out) * (r + 1))
        same(t.grad, blocks * scale)
        ts = [torch.ones(4 * n, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        for o in hvd.grouped_reducescatter(ts, op=op):
            o.backward(torch.ones_like(o) * (r + 1))
        for t in ts:
            same(t.grad, blocks * scale)
    t = torch.ones(2 * n, dtype=torch.float64, requires_grad=True)
    out = hvd.reducescatter(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    out.backward(torch.ones_like(out))
    same(t.grad, torch.full((2 * n,), 1.5 * n, dtype=torch.float64))


# -- error types -------------------------------------------------------------------------
@check
def errors_have_horovods_types_on_every_rank():
    n = hvd.size()
    t = torch.ones(4 * n)
    e = raises(RuntimeError, hvd.reducescatter, t, op=hvd.Adasum)
    assert isinstance(e, ValueError) and not isinstance(e, hvd.HorovodInternalError)
    raises(RuntimeError, hvd.reducescatter, t, op=hvd.Min)
    raises(RuntimeError, hvd.reducescatter, torch.tensor(float(hvd.rank())))
    raises(RuntimeError, hvd.grouped_reducescatter_async, [t], op=hvd.Max)
    if n & (n - 1):
        raises(NotImplementedError, hvd.allreduce, torch.ones(3), op=hvd.Adasum)
    raises(NotImplementedError, hvd.allreduce, torch.ones(3, dtype=torch.int32), op=hvd.Adasum)


# -- sparse ------------------------------------------------------------------------------
@check
def sparse_handles_work_with_synchronize_and_call():
    r, n = hvd.rank(), hvd.size()
    sp = torch.sparse_coo_tensor(torch.tensor([[r, 9]]), torch.tensor([1.0, 2.0]), (10,))
    expect = torch.zeros(10)
    expect[:n] = 1.0
    expect[9] = 2.0 * n
    same(hvd.synchronize(hvd.sparse_allreduce_async(sp, "sp_sum", hvd.Sum)).to_dense(), expect)
    handle = hvd.sparse_allreduce_async(sp, name="sp_avg", op=hvd.Average)
    same(handle().to_dense(), expect / n)
    members = [0, n - 1]
    ps = hvd.add_process_set(members)
    try:
        if ps.included():
            handle = hvd.sparse_allreduce_async(sp, "sp_set", hvd.Average, process_set=ps)
            got = handle().to_dense()
            want = torch.zeros(10)
            want[members] = 0.5
            want[9] = 2.0
            same(got, want)
    finally:
        hvd.remove_process_set(ps)


# -- optimizer ---------------------------------------------------------------------------
@check
def broadcast_optimizer_state_of_a_fresh_optimizer():
    r = hvd.rank()

    class NoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                        requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(4))

    model = NoGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                          nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    frozen, trained = opt.param_groups[0]["params"]
    assert frozen.grad is None
    same(hvd.broadcast(trained.grad, root_rank=0), torch.zeros(4))
    # state on the root for one parameter only, other hyper-parameters elsewhere
    lin = torch.nn.Linear(3, 2)
    plain = torch.optim.SGD(lin.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    if r == 0:
        lin.weight.grad = torch.ones(2, 3)
        plain.step()
    hvd.broadcast_optimizer_state(plain, root_rank=0)
    assert plain.param_groups[0]["lr"] == 0.1
    same(plain.state[lin.weight]["momentum_buffer"], torch.ones(2, 3))
    assert lin.bias not in plain.state or not plain.state[lin.bias]


@check
def optimizer_names_parameters_by_position_and_warns_once():
    r = hvd.rank()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1))
    names = getattr(opt, HOROVOD_NAMES_ATTRIBUTE)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert set(names) == set(params) and names == opt.parameter_names
    assert sorted(names.values()) == sorted(f"allreduce.noname.{i}" for i in range(4))
    x = torch.ones(2, 4) * (r + 1)
    for inside_skip in (False, True):
        opt.zero_grad()
        model(x).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if inside_skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        messages = [str(w.message) for w in caught]
        if inside_skip:
            assert not messages, messages
        else:
            assert len(messages) == 1, messages
            assert "optimizer.step() called without optimizer.skip_synchronize()" in messages[0]
    opt.zero_grad()
    model(x).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    assert not caught, [str(w.message) for w in caught]


@check
def optimizer_reduces_over_its_process_set():
    r, n = hvd.rank(), hvd.size()
    members = [0, n - 1]
    ps = hvd.add_process_set(members)
    try:
        for op, predivide in ((hvd.Average, 1.0), (hvd.Average, 2.0), (hvd.Sum, 1.0)):
            w = torch.nn.Parameter(torch.zeros(3))
            opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), op=op,
                                           gradient_predivide_factor=predivide, process_set=ps)
            assert opt.process_set is ps
            (w * (r + 1) ** 2).sum().backward()
            opt.step()
            if r in members:
                total = float(sum((k + 1) ** 2 for k in members))
                expect = total / len(members) if op == hvd.Average else total
            else:
                expect = float((r + 1) ** 2)        # outside the set: its own gradient
            same(w.detach(), torch.full((3,), -expect))
        raises(ValueError, hvd.DistributedOptimizer, torch.optim.SGD([w], lr=1.0),
               process_set=hvd.ProcessSet([0]))   # not registered
    finally:
        hvd.remove_process_set(ps)
    # every rank in a set of its own parity, each set reducing on its own
    parity = [hvd.add_process_set([k for k in range(n) if k % 2 == p]) for p in (0, 1)]
    try:
        mine = parity[r % 2]
        w = torch.nn.Parameter(torch.zeros(2))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), process_set=mine)
        (w * (r + 1) ** 2).sum().backward()
        opt.step()
        expect = sum((k + 1) ** 2 for k in mine.ranks) / mine.size()
        same(w.detach(), torch.full((2,), -float(expect)))
    finally:
        for s in parity:
            hvd.remove_process_set(s)
