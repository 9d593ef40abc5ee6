"""elastic.torch's Horovod surface in one process (size 1), and its pure parts.

The multi-process behaviours are in tests/test_hvd_ops.py.
"""

import pytest
import torch

import elastic.torch as hvd
from elastic.torch import adasum, negotiation, reduce_ops

HOROVOD_NAMES = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "synchronize",
]


def test_every_horovod_name_is_there():
    missing = [n for n in HOROVOD_NAMES if not hasattr(hvd, n)]
    assert not missing
    assert set(HOROVOD_NAMES) <= set(hvd.__all__)


def test_init_takes_horovods_arguments():
    hvd.init(process_sets=[])
    hvd.init(process_sets="dynamic")
    with pytest.raises(ValueError, match="MPI"):
        hvd.init(comm=object())
    ps = hvd.ProcessSet([0])
    hvd.init(process_sets=[ps])
    assert ps.process_set_id is not None and ps.included()
    assert hvd.allreduce(torch.ones(1), process_set=ps).tolist() == [1.0]
    assert hvd.remove_process_set(ps)
    with pytest.warns(UserWarning, match="not provided"):
        hvd.start_timeline("/tmp/x.json")


def test_queries():
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert not (hvd.mpi_built() or hvd.mpi_enabled() or hvd.ccl_built() or hvd.ddl_built()
                or hvd.rocm_built())
    assert hvd.nccl_built() == 0 or torch.cuda.is_available()
    hvd.init()
    assert hvd.is_homogeneous()


def test_size_one_keeps_dtypes_and_scales_like_horovod():
    hvd.init()
    t = torch.tensor([5, -5, 7], dtype=torch.int32)
    out = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5)
    assert out.dtype == torch.int32 and out.tolist() == [2, -2, 3]     # truncated, as Horovod
    assert hvd.allreduce(t).dtype == torch.int32
    h = torch.tensor([1.0, 3.0], dtype=torch.float16)
    assert hvd.allreduce(h, postscale_factor=0.5).dtype == torch.float16
    assert hvd.allreduce(torch.ones(2), op=hvd.Adasum).tolist() == [1.0, 1.0]
    assert hvd.reducescatter(torch.ones(3, 2)).shape == (3, 2)
    out, splits = hvd.alltoall(torch.arange(4), torch.tensor([4], dtype=torch.int32))
    assert out.tolist() == [0, 1, 2, 3] and splits.tolist() == [4]


def test_handles_and_names():
    hvd.init()
    handle = hvd.allreduce_async(torch.ones(3), name="x")
    with pytest.raises(ValueError, match="in flight"):
        hvd.allreduce_async(torch.ones(3), name="x")
    hvd.allgather_async(torch.ones(3), name="x")          # another op kind may share a name
    assert hvd.poll(handle) and hvd.synchronize(handle).tolist() == [1.0] * 3
    hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="x"))
    with pytest.raises(ValueError):
        hvd.synchronize(42)
    outs = hvd.synchronize(hvd.grouped_allreduce_async([torch.ones(1), torch.zeros(2)]))
    assert [o.tolist() for o in outs] == [[1.0], [0.0, 0.0]]


def test_argument_errors_are_value_errors():
    hvd.init()
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(1), op="median")
    with pytest.raises(ValueError):
        hvd.alltoall(torch.ones(3), torch.tensor([1.0]))
    with pytest.raises(ValueError):
        hvd.alltoall(torch.ones(1), torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError):
        hvd.reducescatter(torch.ones(2), op=hvd.Max)
    with pytest.raises(ValueError):
        hvd.broadcast(torch.ones(1), 1)
    with pytest.raises(ValueError, match="power-of-two"):
        adasum.check([torch.ones(1)], type("B", (), {"size": 3})())
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(1, dtype=torch.int64), op=hvd.Adasum)
    for bad in ("ab", [], [1, 1], [-1]):
        with pytest.raises(ValueError):
            hvd.ProcessSet(bad)


def test_gradients_at_size_one():
    hvd.init()
    x = torch.ones(4, 2, requires_grad=True)
    loss = (hvd.allreduce(x).sum() + hvd.allgather(x).sum() + hvd.broadcast(x, 0).sum()
            + hvd.alltoall(x).sum() + hvd.reducescatter(x).sum()
            + sum(o.sum() for o in hvd.grouped_allreduce([x])))
    loss.backward()
    assert torch.equal(x.grad, torch.full((4, 2), 6.0))


def test_sync_batch_norm_at_size_one_is_batch_norm():
    hvd.init()
    torch.manual_seed(0)
    x = torch.randn(6, 3, 5) * 2 + 1
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    sync, plain = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    (sync(a) * torch.arange(5.0)).sum().backward()
    (plain(b) * torch.arange(5.0)).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-5)
    assert torch.allclose(sync.weight.grad, plain.weight.grad, atol=1e-5)
    assert torch.allclose(sync.running_var, plain.running_var, atol=1e-6)


def test_adasum_combination():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    assert torch.equal(adasum.combine(a, b).float(), torch.tensor([1.0, 2.0]))   # orthogonal
    assert torch.allclose(adasum.combine(a, a).float(), a)                        # parallel
    x, y = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    d = x @ y
    assert torch.allclose(adasum.combine(x, y), (1 - d / (2 * x @ x)) * x + (1 - d / (2 * y @ y)) * y)
    assert torch.equal(adasum.combine(torch.zeros(3), y[:3]), y[:3])


def test_scaling_and_splits():
    t = torch.tensor([7, -7], dtype=torch.int64)
    assert reduce_ops.scale_(t, 1 / 2).tolist() == [3, -3]
    assert reduce_ops.split_sizes(7, 3) == [3, 2, 2] and reduce_ops.split_sizes(2, 3) == [1, 1, 0]


class _Binding:
    def __init__(self, n):
        self.ranks, self.size = list(range(n)), n

    def global_rank(self, r):
        return r


@pytest.mark.parametrize("recs, expect", [
    ((dict(kind=1), dict(kind=2)), "collectives differ"),
    ((dict(shape=[3]), dict(shape=[4])), "shapes differ"),
    ((dict(dtype=torch.int32), dict(dtype=torch.float32)), "dtypes differ"),
    ((dict(root=0), dict(root=1)), "root ranks differ"),
    ((dict(name="a"), dict(name="b")), "names"),
    ((dict(shape=[3, 2]), dict(shape=[6])), "numbers of dimensions"),
    ((dict(op=1), dict(op=2)), "reduction ops"),
    ((dict(), dict()), None),
])
def test_the_check_names_what_differs(recs, expect):
    records = []
    for r in recs:
        t = torch.zeros(r.get("shape", [3]), dtype=r.get("dtype", torch.float32))
        records.append(negotiation.record(r.get("kind", 1), [t], op=r.get("op", 1),
                                          root=r.get("root", -1), name=r.get("name")))
    out = negotiation.Outcome(records)
    error = negotiation.check_records(out, _Binding(2), "op", False)
    if expect is None:
        assert error is None
    else:
        assert isinstance(error, hvd.CollectiveMismatchError) and expect in str(error), error


def test_allgather_check_allows_a_different_first_dimension():
    recs = [negotiation.record(2, [torch.zeros(n, 4)], vary_dim0=True) for n in (3, 5)]
    out = negotiation.Outcome(recs)
    assert negotiation.check_records(out, _Binding(2), "allgather", True) is None
    assert out.dim0s() == [3, 5]
