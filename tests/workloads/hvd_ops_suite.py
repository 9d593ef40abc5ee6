"""Horovod's PyTorch op behaviours, checked on one real elasticrun job.

Written here after the behaviours that Horovod's test/parallel/test_torch.py
checks (not copied). Every check runs on every rank; each rank writes
``ops.<rank>.json`` with one entry per check, which tests/test_hvd_ops.py
asserts. Torch is imported once per worker for the whole suite.
"""

import itertools
import json
import os
import sys
import time
import traceback

import hvd_fidelity_checks
import torch
from job_helpers import raises, same

import elastic.torch as hvd

CHECKS = {}
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DIMS = [1, 2, 3]


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def sample(dim, dtype, seed=1234, lo=-100, hi=100):
    torch.manual_seed(seed)
    if dtype in (torch.uint8, torch.bool):
        lo = 0
    return torch.empty([17] * dim).random_(lo, hi).to(dtype)


# -- basics ------------------------------------------------------------------------------
@check
def basics_rank_size_env():
    assert hvd.is_initialized()
    assert 0 <= hvd.rank() < hvd.size()
    assert int(os.environ["HOROVOD_RANK"]) == hvd.rank()
    assert int(os.environ["HOROVOD_SIZE"]) == hvd.size()


@check
def queries_answer_truthfully():
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert not hvd.mpi_built() and not hvd.mpi_enabled() and not hvd.mpi_threads_supported()
    assert not hvd.ccl_built() and not hvd.ddl_built() and not hvd.rocm_built()
    torch_nccl = torch.distributed.is_nccl_available() and torch.cuda.is_available()
    assert bool(hvd.nccl_built()) == torch_nccl
    assert hvd.cuda_built() == torch.backends.cuda.is_built()


# -- allreduce ---------------------------------------------------------------------------
@check
def allreduce_sum_keeps_dtype():
    for dtype, dim in itertools.product(INTS + FLOATS, DIMS):
        t = sample(dim, dtype, lo=-3, hi=4)
        summed = hvd.allreduce(t, average=False)
        same(summed, (t.double() * hvd.size()).to(dtype))


@check
def allreduce_average_keeps_dtype():
    for dtype, dim in itertools.product([torch.int32, torch.int64] + FLOATS, DIMS):
        t = sample(dim, dtype)
        for out in (hvd.allreduce(t, average=True), hvd.allreduce(t, op=hvd.Average)):
            if dtype == torch.bfloat16:      # 8 significant bits: the sum itself rounds
                assert out.dtype == dtype and torch.allclose(out.float(), t.float(), rtol=1e-2)
            else:
                same(out, t)


@check
def allreduce_integer_average_truncates():
    t = torch.tensor([hvd.rank() * 3 + 1, -(hvd.rank() * 3 + 1)], dtype=torch.int64)
    total = sum(r * 3 + 1 for r in range(hvd.size()))
    expect = torch.tensor([total, -total], dtype=torch.float64) / hvd.size()
    same(hvd.allreduce(t), expect.to(torch.int64))


@check
def allreduce_inplace():
    for dtype, dim in itertools.product(INTS + FLOATS, DIMS):
        t = sample(dim, dtype, lo=-3, hi=4)
        expect = (t.double() * hvd.size()).to(dtype)
        out = hvd.allreduce_(t, average=False)
        assert out is t
        same(t, expect)


@check
def allreduce_min_max_product():
    r, n = hvd.rank(), hvd.size()
    for dtype in [torch.int32, torch.int64, torch.float32, torch.float64]:
        t = torch.tensor([r + 1, -(r + 1), 2], dtype=dtype)
        same(hvd.allreduce(t, op=hvd.Min), torch.tensor([1, -n, 2], dtype=dtype))
        same(hvd.allreduce(t, op=hvd.Max), torch.tensor([n, -1, 2], dtype=dtype))
        fact = 1
        for k in range(1, n + 1):
            fact *= k
        same(hvd.allreduce(t, op=hvd.Product),
             torch.tensor([fact, (-1) ** n * fact, 2 ** n], dtype=dtype))


@check
def allreduce_async_handles():
    tests, ever_pending = [], False
    for dtype, dim in itertools.product([torch.int32, torch.int64] + FLOATS, DIMS):
        t = sample(dim, dtype, lo=-3, hi=4)
        handle = hvd.allreduce_async(t, average=False)
        ever_pending |= not hvd.poll(handle)
        tests.append((handle, (t.double() * hvd.size()).to(dtype)))
    for handle, expect in tests:
        same(hvd.synchronize(handle), expect)
        assert hvd.poll(handle) is True
    RESULTS_EXTRA["poll_was_pending"] = ever_pending


@check
def allreduce_prescale_postscale():
    n = hvd.size()
    for dtype, dim, where in itertools.product([torch.int32, torch.int64] + FLOATS, DIMS,
                                               ["pre", "post"]):
        factor = 0.3711
        t = sample(dim, dtype)
        kwargs = {f"{where}scale_factor": factor}
        out = hvd.allreduce(t, average=False, **kwargs)
        compute = torch.float64 if not dtype.is_floating_point else \
            torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        f = torch.tensor(factor, dtype=torch.float64).to(compute)
        if where == "pre":
            expect = (f * t.to(compute)).to(dtype).to(compute) * n
        else:
            expect = (t.to(compute) * n) * f
        assert out.dtype == dtype
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
        assert torch.allclose(out.to(torch.float64), expect.to(dtype).to(torch.float64),
                              rtol=tol, atol=tol), (dtype, where)


@check
def allreduce_mismatch_raises_everywhere_and_group_survives():
    r = hvd.rank()
    t = torch.ones([17 + r] * 3)
    raises(RuntimeError, hvd.allreduce, t)
    t = torch.ones([17, 23 * 57]) if r == 0 else torch.ones([17, 23, 57])
    e = raises(RuntimeError, hvd.allreduce, t)
    assert not isinstance(e, hvd.HorovodInternalError), "a mismatch must not look like a departure"
    t = torch.ones(17, dtype=torch.int32) if r % 2 == 0 else torch.ones(17)
    e = raises(hvd.CollectiveMismatchError, hvd.allreduce, t)
    assert "dtype" in str(e), e
    same(hvd.allreduce(torch.ones(3), average=False), torch.full((3,), float(hvd.size())))


@check
def different_ops_raise_instead_of_hanging():
    fn = hvd.allreduce if hvd.rank() == 0 else hvd.allgather
    e = raises(hvd.CollectiveMismatchError, fn, torch.ones(4))
    assert "collectives differ" in str(e), e


@check
def duplicate_names_in_flight_rejected():
    t = torch.ones(17, 17)
    first = hvd.allreduce_async(t, name="duplicate_name")
    raises(ValueError, hvd.allreduce_async, t, name="duplicate_name")
    hvd.synchronize(first)
    hvd.synchronize(hvd.allreduce_async(t, name="duplicate_name"))   # free again
    g = hvd.allgather_async(t, name="dup_gather")
    raises(ValueError, hvd.allgather_async, t, name="dup_gather")
    b = hvd.broadcast_async(t, 0, name="dup_bcast")
    raises(ValueError, hvd.broadcast_async, t, root_rank=0, name="dup_bcast")
    hvd.synchronize(g)
    hvd.synchronize(b)


@check
def allreduce_gradients():
    for dtype, dim, average in itertools.product([torch.float32, torch.float64], DIMS,
                                                 [False, True]):
        t = sample(dim, dtype).requires_grad_()
        hvd.allreduce(t, average=average).backward(torch.ones([17] * dim, dtype=dtype))
        expect = torch.ones([17] * dim, dtype=dtype) * (1 if average else hvd.size())
        same(t.grad, expect)


@check
def grouped_allreduce_variants():
    n = hvd.size()
    for dtype, dim in itertools.product([torch.int32, torch.int64] + FLOATS, DIMS):
        ts = [sample(dim, dtype, seed=s, lo=-3, hi=4) for s in range(5)]
        for out, t in zip(hvd.grouped_allreduce(ts, average=False), ts):
            same(out, (t.double() * n).to(dtype))
        for out, t in zip(hvd.grouped_allreduce(ts, average=True), ts):
            same(out, t)
        expect = [(t.double() * n).to(dtype) for t in ts]
        hvd.grouped_allreduce_(ts, average=False)
        for t, e in zip(ts, expect):
            same(t, e)
    ts = [torch.ones(3) * (i + 1) for i in range(3)]
    outs = hvd.synchronize(hvd.grouped_allreduce_async(ts, op=hvd.Sum))
    for i, out in enumerate(outs):
        same(out, torch.full((3,), float((i + 1) * n)))


@check
def grouped_allreduce_gradients():
    for dtype, average in itertools.product([torch.float32, torch.float64], [False, True]):
        ts = [sample(2, dtype, seed=s).requires_grad_() for s in range(3)]
        for s in hvd.grouped_allreduce(ts, average=average):
            s.backward(torch.ones_like(s))
        for t in ts:
            same(t.grad, torch.ones_like(t) * (1 if average else hvd.size()))


@check
def adasum_matches_reference_or_refuses():
    n, r = hvd.size(), hvd.rank()

    def grad_of(rank):
        g = torch.Generator().manual_seed(100 + rank)
        return torch.randn(64, generator=g, dtype=torch.float64).float(), \
            torch.randn(3, 4, generator=g, dtype=torch.float64).float()

    if n & (n - 1):
        e = raises(ValueError, hvd.allreduce, grad_of(r)[0], op=hvd.Adasum)
        assert "power-of-two" in str(e), e
        return

    def combine(a, b):
        dot = (a * b).sum()
        return (1 - dot / (2 * (a * a).sum())) * a + (1 - dot / (2 * (b * b).sum())) * b

    def reference(index):
        level = [grad_of(k)[index].double() for k in range(n)]
        while len(level) > 1:
            level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        return level[0]

    mine = grad_of(r)
    out = hvd.allreduce(mine[0], op=hvd.Adasum)
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), reference(0), rtol=1e-5, atol=1e-6)
    outs = hvd.grouped_allreduce(list(mine), op=hvd.Adasum)
    for i, out in enumerate(outs):
        assert torch.allclose(out.double(), reference(i), rtol=1e-5, atol=1e-6)
    # equal gradients give their average; orthogonal ones their sum
    same_in = torch.ones(5)
    assert torch.allclose(hvd.allreduce(same_in, op=hvd.Adasum), same_in)
    if n == 2:
        ortho = torch.tensor([1.0, 0.0]) if r == 0 else torch.tensor([0.0, 1.0])
        assert torch.equal(hvd.allreduce(ortho, op=hvd.Adasum), torch.tensor([1.0, 1.0]))
    digests = hvd.allgather_object(out.tolist())
    assert all(d == digests[0] for d in digests), "ranks disagree on the Adasum result"
    raises(ValueError, hvd.allreduce, torch.ones(3, dtype=torch.int32), op=hvd.Adasum)


# -- allgather ---------------------------------------------------------------------------
@check
def allgather_all_dtypes():
    r, n = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(INTS + FLOATS + [torch.bool, torch.complex64], DIMS):
        t = (torch.ones([17] * dim) * (r % 2 if dtype == torch.bool else r)).to(dtype)
        gathered = hvd.allgather(t)
        assert gathered.dtype == dtype and list(gathered.shape) == [17 * n] + [17] * (dim - 1)
        for i in range(n):
            piece = gathered[i * 17:(i + 1) * 17]
            assert torch.equal(piece, (torch.ones_like(t, dtype=torch.float32)
                                       * (i % 2 if dtype == torch.bool else i)).to(dtype))


@check
def allgather_variable_first_dimension():
    r, n = hvd.rank(), hvd.size()
    sizes = [17, 32, 81, 12, 15, 23, 22][:n]
    for dtype, dim in itertools.product([torch.int16, torch.int32, torch.float32], DIMS):
        t = (torch.ones([sizes[r]] + [17] * (dim - 1)) * r).to(dtype)
        gathered = hvd.allgather(t)
        assert list(gathered.shape) == [sum(sizes)] + [17] * (dim - 1)
        for i in range(n):
            piece = gathered[sum(sizes[:i]):sum(sizes[:i + 1])]
            assert piece.shape[0] == sizes[i] and int(piece.min()) == i == int(piece.max())
    outs = hvd.grouped_allgather([torch.ones(r + 1) * r, torch.ones(2, 3) * r])
    assert outs[0].tolist() == [float(i) for i in range(n) for _ in range(i + 1)]
    assert outs[1].shape == (2 * n, 3)


@check
def allgather_async_and_errors():
    r, n = hvd.rank(), hvd.size()
    handles = [hvd.allgather_async(torch.ones(17, d + 1) * r) for d in range(4)]
    for d, h in enumerate(handles):
        out = hvd.synchronize(h)
        assert out.shape == (17 * n, d + 1) and int(out[-1, 0]) == n - 1
    raises(RuntimeError, hvd.allgather, torch.ones(17, 10 * (r + 1), 17))
    t = torch.ones(17, 17, dtype=torch.int32) if r % 2 == 0 else torch.ones(17, 17)
    raises(RuntimeError, hvd.allgather, t)


@check
def allgather_gradient():
    r, n = hvd.rank(), hvd.size()
    sizes = [3, 2, 7, 4, 6, 8, 10][:n]
    for dtype, dim in itertools.product([torch.float32, torch.float64], DIMS):
        t = (torch.ones([sizes[r]] + [17] * (dim - 1), dtype=dtype) * r).requires_grad_()
        grad_ys = torch.cat([torch.ones([s] + [17] * (dim - 1), dtype=dtype) * i
                             for i, s in enumerate(sizes)])
        hvd.allgather(t).backward(grad_ys)
        same(t.grad, torch.ones_like(t) * r)      # the average of equal gradients


# -- broadcast ---------------------------------------------------------------------------
@check
def broadcast_all_dtypes_and_roots():
    r, n = hvd.rank(), hvd.size()
    for dtype, dim, root in itertools.product(INTS + FLOATS + [torch.complex64], DIMS, range(n)):
        t = (torch.ones([17] * dim) * r).to(dtype)
        root_t = (torch.ones([17] * dim) * root).to(dtype)
        out = hvd.broadcast(t, root)
        same(out, root_t)
        if r != root:
            assert not torch.equal(t, root_t), "broadcast modified its input"
        t2 = (torch.ones([17] * dim) * r).to(dtype)
        assert hvd.broadcast_(t2, root) is t2
        same(t2, root_t)
    base = torch.arange(12.0).reshape(3, 4) * (r + 1)
    view = base.t()                          # not contiguous
    hvd.broadcast_(view, 0)
    same(base, torch.arange(12.0).reshape(3, 4))
    out = hvd.synchronize(hvd.broadcast_async(torch.ones(3) * r, root_rank=n - 1))
    same(out, torch.full((3,), float(n - 1)))


@check
def broadcast_errors():
    r, n = hvd.rank(), hvd.size()
    raises(RuntimeError, hvd.broadcast, torch.ones(17, 10 * (r + 1), 17), 0)
    t = torch.ones(17, dtype=torch.int32) if r % 2 == 0 else torch.ones(17)
    raises(RuntimeError, hvd.broadcast, t, 0)
    e = raises(RuntimeError, hvd.broadcast, torch.ones(17), r)
    assert "root ranks differ" in str(e), e
    raises(ValueError, hvd.broadcast, torch.ones(3), n)
    raises(ValueError, hvd.broadcast, torch.ones(3), -1)


@check
def broadcast_gradient():
    r, n = hvd.rank(), hvd.size()
    for dtype, dim, root in itertools.product([torch.float32, torch.float64], DIMS, range(n)):
        t = (torch.ones([17] * dim, dtype=dtype) * r).requires_grad_()
        hvd.broadcast(t, root).backward(torch.ones([17] * dim, dtype=dtype))
        same(t.grad, torch.ones_like(t) * (1 if r == root else 0))


# -- alltoall ----------------------------------------------------------------------------
def _alltoall_input(dim, dtype):
    r, n = hvd.rank(), hvd.size()
    t = torch.tensor([float(i) for i in range(n) for _ in range(r + 1)])
    for _ in range(dim - 1):
        t = torch.cat((t.unsqueeze(1), t.unsqueeze(1)), dim=1)
    return t.to(dtype)


@check
def alltoall_with_and_without_splits():
    r, n = hvd.rank(), hvd.size()
    for dtype, dim in itertools.product(INTS + FLOATS, DIMS):
        t = _alltoall_input(dim, dtype)
        splits = torch.tensor([r + 1] * n, dtype=torch.int32)
        out, received = hvd.alltoall(t, splits)
        assert out.dtype == dtype
        assert int(out.min()) == r == int(out.max())
        assert out.numel() == n * (n + 1) // 2 * 2 ** (dim - 1)
        assert received.tolist() == [i + 1 for i in range(n)] and received.dtype == torch.int32
        equal = torch.arange(n).repeat_interleave(2).to(dtype)
        got = hvd.alltoall(equal)
        same(got, torch.full((2 * n,), r).to(dtype))
    out, received = hvd.synchronize(hvd.alltoall_async(torch.arange(n) + 10 * r))
    same(out, torch.arange(n) * 10 + r)


@check
def alltoall_errors():
    r, n = hvd.rank(), hvd.size()
    t = torch.empty(n, dtype=torch.int32) if r % 2 else torch.empty(n)
    raises(RuntimeError, hvd.alltoall, t)
    raises(ValueError, hvd.alltoall, torch.empty(n + 1))
    raises(ValueError, hvd.alltoall, torch.empty(n - 1), torch.ones(n, dtype=torch.int32))
    raises(ValueError, hvd.alltoall, torch.empty(n), torch.empty(n, dtype=torch.float32))
    raises(RuntimeError, hvd.alltoall, torch.ones(2 * n, 10 * (r + 1), 2 * n))


@check
def alltoall_gradients():
    r, n = hvd.rank(), hvd.size()
    for dtype, dim, with_splits in itertools.product([torch.float32, torch.float64], DIMS,
                                                     [True, False]):
        t = _alltoall_input(dim, dtype).requires_grad_()
        if with_splits:
            out, _ = hvd.alltoall(t, torch.tensor([r + 1] * n, dtype=torch.int32))
        else:
            out = hvd.alltoall(t) if t.shape[0] % n == 0 else None
            if out is None:
                continue
        out.backward(torch.ones_like(out))
        same(t.grad, torch.ones_like(t))


# -- reducescatter -----------------------------------------------------------------------
@check
def reducescatter_sum_average_uneven():
    r, n = hvd.rank(), hvd.size()
    for dtype, rows in itertools.product([torch.int32, torch.int64, torch.float32,
                                          torch.float64, torch.float16], [2 * n, 2 * n + 1]):
        t = (torch.arange(rows * 3).reshape(rows, 3) + r).to(dtype)
        full = sum((torch.arange(rows * 3).reshape(rows, 3) + k).double() for k in range(n))
        counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
        start = sum(counts[:r])
        mine = full[start:start + counts[r]]
        same(hvd.reducescatter(t, op=hvd.Sum), mine.to(dtype))
        avg = hvd.reducescatter(t)
        assert avg.dtype == dtype and avg.shape[0] == counts[r]
        assert torch.allclose(avg.double(), (mine / n).to(dtype).double(), atol=0.1 if
                              dtype == torch.float16 else 1e-6)
    outs = hvd.grouped_reducescatter([torch.ones(n, 2), torch.ones(2 * n)], op=hvd.Sum)
    same(outs[0], torch.full((1, 2), float(n)))
    same(outs[1], torch.full((2,), float(n)))
    same(hvd.synchronize(hvd.reducescatter_async(torch.ones(n), op=hvd.Sum)),
         torch.full((1,), float(n)))
    raises(ValueError, hvd.reducescatter, torch.ones(n), op=hvd.Min)
    raises(RuntimeError, hvd.reducescatter, torch.ones(n + r, 2))


@check
def reducescatter_gradient():
    r, n = hvd.rank(), hvd.size()
    for op in (hvd.Sum, hvd.Average):
        t = torch.ones(2 * n + 1, 3, dtype=torch.float64, requires_grad=True)
        out = hvd.reducescatter(t, op=op)
        out.backward(torch.ones_like(out) * (r + 1))
        counts = [(2 * n + 1) // n + (1 if k < (2 * n + 1) % n else 0) for k in range(n)]
        expect = torch.cat([torch.full((c, 3), float(k + 1), dtype=torch.float64)
                            for k, c in enumerate(counts)])
        same(t.grad, expect * (n if op == hvd.Sum else 1))


# -- join --------------------------------------------------------------------------------
@check
def join_with_allreduce():
    r, n = hvd.rank(), hvd.size()
    for dtype, first in itertools.product([torch.int32, torch.int64, torch.float32,
                                           torch.float64], [0, 1]):
        a, b = sample(1, dtype, seed=1), sample(2, dtype, seed=2)
        if r == first:
            last = hvd.join()
        else:
            ha = hvd.allreduce_async(a, name="tensor_a", average=True)
            hb = hvd.allreduce_async(b, name="tensor_b", average=True)
            avg_a, avg_b = hvd.synchronize(ha), hvd.synchronize(hb)
            mx = hvd.allreduce(torch.tensor([r], dtype=dtype), op=hvd.Max)
            last = hvd.join()
            for t, got in ((a, avg_a), (b, avg_b)):
                expect = (t.double() * (n - 1) / n).to(dtype) if not dtype.is_floating_point \
                    else t * (n - 1) / n
                assert torch.allclose(got.double(), expect.double()), (dtype, got, expect)
            assert int(mx) == max(k for k in range(n) if k != first)
        lasts = hvd.allgather_object(last)
        assert len(set(lasts)) == 1 and lasts[0] != first, lasts


@check
def join_with_other_ops_raises():
    r = hvd.rank()
    for fn in (lambda: hvd.allgather(torch.ones(17)), lambda: hvd.broadcast(torch.ones(3), 1)):
        if r == 0:
            hvd.join()
        else:
            raises(RuntimeError, fn)
            hvd.join()


# -- objects, barrier, sparse, compression ----------------------------------------------
@check
def objects_and_barrier():
    expected = {"hello": 123, 0: [1, 2]}
    obj = hvd.broadcast_object(expected if hvd.rank() == 0 else {}, root_rank=0, name="obj")
    assert obj == expected
    d = {"metric_val_1": hvd.rank()}
    if hvd.rank() == 1:
        d["metric_val_2"] = 42
    got = hvd.allgather_object(d, name="metrics")
    want = [{"metric_val_1": i} for i in range(hvd.size())]
    want[1] = {"metric_val_1": 1, "metric_val_2": 42}
    assert got == want, got
    hvd.barrier()


@check
def sparse_allreduce_and_fp16_compression():
    r, n = hvd.rank(), hvd.size()
    sp = torch.sparse_coo_tensor(torch.tensor([[r, 9]]), torch.tensor([1.0, 2.0]), (10,))
    out = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sparse", op=hvd.Sum))
    dense = out.to_dense()
    assert dense[9] == 2.0 * n and all(dense[k] == 1.0 for k in range(n) if k != 9)
    t = torch.ones(5, dtype=torch.float32) * (r + 1)
    got = hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert got.dtype == torch.float32 and torch.equal(got, torch.full((5,),
                                                                      float(n * (n + 1) / 2)))


# -- SyncBatchNorm -----------------------------------------------------------------------
@check
def sync_batch_norm_matches_full_batch():
    r, n = hvd.rank(), hvd.size()
    for shape in [(n, 4, 2), (n, 4)]:
        torch.manual_seed(7)
        full = torch.randn(*shape) * 3 + 1
        sync_bn, bn = hvd.SyncBatchNorm(4), torch.nn.BatchNorm1d(4)
        mine = full[r:r + 1].clone().requires_grad_()
        ref = full.clone().requires_grad_()
        out, ref_out = sync_bn(mine), bn(ref)
        assert torch.allclose(out, ref_out[r:r + 1], atol=1e-5)
        assert torch.allclose(sync_bn.running_mean, bn.running_mean, atol=1e-5)
        assert torch.allclose(sync_bn.running_var, bn.running_var, atol=1e-5)
        out.sum().backward()
        ref_out.mean(dim=0).sum().backward()
        assert torch.allclose(hvd.allreduce(sync_bn.weight.grad), bn.weight.grad, atol=1e-5)
        assert torch.allclose(hvd.allreduce(sync_bn.bias.grad), bn.bias.grad, atol=1e-5)
        grad_in = torch.zeros_like(full)
        grad_in[r:r + 1] = mine.grad
        assert torch.allclose(hvd.allreduce(grad_in, op=hvd.Sum) / n, ref.grad, atol=1e-5)
        sync_bn.eval()
        assert torch.allclose(sync_bn(full), bn.eval()(full), atol=1e-5)


# -- process sets ------------------------------------------------------------------------
@check
def process_sets_run_ops_among_members():
    r, n = hvd.rank(), hvd.size()
    assert hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r
    evens = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    odds = hvd.add_process_set(hvd.ProcessSet([k for k in range(n) if k % 2 == 1]))
    mine, other = (evens, odds) if r % 2 == 0 else (odds, evens)
    assert mine.included() and not other.included() and other.rank() == -1
    assert mine.rank() == mine.ranks.index(r)
    members = mine.ranks
    same(hvd.allreduce(torch.tensor([r]), op=hvd.Sum, process_set=mine),
         torch.tensor([sum(members)]))
    same(hvd.allgather(torch.tensor([r]), process_set=mine), torch.tensor(members))
    same(hvd.broadcast(torch.tensor([r]), members[-1], process_set=mine),
         torch.tensor([members[-1]]))
    assert hvd.allgather_object(r, process_set=mine) == members
    k = len(members)
    out, received = hvd.alltoall(torch.arange(k) + 10 * r, torch.ones(k, dtype=torch.int32),
                                 process_set=mine)
    same(out, torch.tensor([10 * m + mine.rank() for m in members]))
    assert received.tolist() == [1] * k
    same(hvd.reducescatter(torch.ones(k, 2) * (r + 1), op=hvd.Sum, process_set=mine),
         torch.full((1, 2), float(sum(m + 1 for m in members))))
    e = raises(hvd.CollectiveMismatchError, hvd.allreduce, torch.ones(1 + mine.rank()),
               process_set=mine) if k > 1 else None
    assert e is None or "shapes differ" in str(e)
    raises(ValueError, hvd.allreduce, torch.ones(1), process_set=other)
    raises(ValueError, hvd.broadcast, torch.ones(1), other.ranks[0], process_set=mine)
    raises(ValueError, hvd.add_process_set, list(members))
    hvd.barrier(process_set=mine)
    assert hvd.remove_process_set(evens) and hvd.remove_process_set(odds)
    assert not hvd.remove_process_set(evens) and not hvd.remove_process_set(hvd.global_process_set)
    raises(ValueError, hvd.allreduce, torch.ones(1), process_set=evens)
    again = hvd.add_process_set(list(range(n)))          # same ranks again: a fresh group
    same(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=again), torch.full((2,), float(n)))
    hvd.remove_process_set(again)
    ruled = hvd.add_process_set(hvd.ProcessSet(lambda size: range(0, size, 2)))
    if ruled.included():
        same(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ruled),
             torch.full((1,), float(len(ruled.ranks))))
    hvd.remove_process_set(ruled)
    raises(ValueError, hvd.add_process_set, [0, n])


CHECKS.update(hvd_fidelity_checks.CHECKS)      # issue 34's checks, in the same job
RESULTS_EXTRA = {}


def wait_for_every_worker():
    """A slow worker joins warm, a round later: commit until the job has its full size."""
    expected = int(os.environ.get("HVD_OPS_SIZE", "0"))

    @hvd.elastic.run
    def wait(state):
        while hvd.size() < expected:
            time.sleep(0.05)
            state.commit()

    wait(hvd.elastic.ObjectState(waited=True))


def main():
    hvd.init()
    wait_for_every_worker()
    out_dir = os.environ["JOB_OUT"]
    rank = hvd.rank()
    only = os.environ.get("HVD_OPS_ONLY")
    results = {}
    path = os.path.join(out_dir, f"ops.{rank}.json")
    for name, fn in CHECKS.items():
        if only and name not in only.split(","):
            continue
        try:
            fn()
            results[name] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - recorded for the test to report
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "trace": traceback.format_exc()[-3000:]}
        with open(path + ".tmp", "w") as f:
            json.dump({"size": hvd.size(), "results": results, "extra": RESULTS_EXTRA}, f)
        os.replace(path + ".tmp", path)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
