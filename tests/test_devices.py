"""Placement rules for the GPU path, checked without a GPU (elastic/worker/devices.py)."""

import pytest
import torch

from elastic.exceptions import ElasticError
from elastic.worker import devices
from elastic.worker.devices import PlacementError, place


def test_auto_picks_nccl_only_where_cuda_is():
    assert devices.choose_backend("auto", cuda_available=True) == "nccl"
    assert devices.choose_backend("auto", cuda_available=False) == "gloo"
    assert devices.choose_backend("", cuda_available=False) == "gloo"
    assert devices.choose_backend("GLOO", cuda_available=True) == "gloo"


def test_nccl_without_cuda_and_unknown_backends_are_errors():
    with pytest.raises(PlacementError, match="nccl"):
        devices.choose_backend("nccl", cuda_available=False)
    with pytest.raises(PlacementError, match="mpi"):
        devices.choose_backend("mpi", cuda_available=True)
    assert issubclass(PlacementError, ElasticError)


def test_nccl_gives_each_worker_its_own_gpu():
    got = [place("auto", r, 4, device_count=4) for r in range(4)]
    assert [p.device for p in got] == [0, 1, 2, 3]
    assert {p.backend for p in got} == {"nccl"}
    assert {p.wait_mode for p in got} == {"poll"}


def test_more_slots_than_gpus_is_one_clear_error_under_nccl():
    with pytest.raises(PlacementError) as info:
        place("nccl", 2, 3, device_count=2, hostname="node-b")
    text = str(info.value)
    assert "node-b runs 3 workers but has 2 GPU(s)" in text
    assert "ELASTIC_BACKEND=gloo" in text
    assert devices.is_repeating_error(info.value)


def test_gloo_shares_gpus_and_runs_on_cpu_without_them():
    shared = [place("gloo", r, 3, device_count=1) for r in range(3)]
    assert [p.device for p in shared] == [0, 0, 0]
    assert {p.backend for p in shared} == {"gloo"}
    assert {p.wait_mode for p in shared} == {"future"}
    assert place("auto", 1, 2, device_count=0) == devices.Placement("gloo", None)
    assert [place("gloo", r, 4, device_count=2).device for r in range(4)] == [0, 1, 0, 1]


def test_nccl_environment_keeps_what_the_user_set():
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    added = devices.nccl_environment(env)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added
    assert added["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    devices.apply_nccl_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


@pytest.mark.parametrize("exc, repeats", [
    (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), False),
    (RuntimeError("Timed out waiting 1000ms for recv operation to complete"), False),
    (RuntimeError("NCCL error: remote process exited or there was a network error"), False),
    (RuntimeError("Tensors must be CUDA and dense; shape mismatch across ranks"), True),
    (RuntimeError("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0"), True),
    (RuntimeError("NCCL error: invalid usage"), True),
    (TypeError("unsupported operand"), True),
    (PlacementError("x"), True),
])
def test_repeating_errors_are_told_from_departed_peers(exc, repeats):
    assert devices.is_repeating_error(exc) is repeats


def test_device_sync_touches_each_cuda_device_once_and_cpu_never():
    assert devices.distinct_devices([torch.zeros(1), torch.ones(2)]) == []
    assert devices.synchronize_devices([torch.zeros(1)]) == 0


# -- the bounded NCCL wait, driven by a work object that behaves as NCCL's does --------------
class _NcclLikeWork:
    """is_completed() turns True after ``ready_after`` polls; wait() never blocks."""

    def __init__(self, ready_after, fail=None):
        self.polls, self.ready_after, self.fail, self.waited = 0, ready_after, fail, False

    def is_completed(self):
        self.polls += 1
        return self.polls > self.ready_after

    def wait(self):
        self.waited = True
        if self.fail:
            raise RuntimeError(self.fail)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_nccl_wait_polls_until_complete():
    from elastic.worker import nccl
    work, clock = _NcclLikeWork(ready_after=5), _Clock()
    nccl.wait_polling(work, 0.01, 10, lambda: False, clock=clock, sleep=clock.sleep)
    assert work.polls == 6 and work.waited


def test_nccl_wait_gives_up_on_abort_and_on_its_deadline_and_aborts_the_group():
    from elastic.exceptions import WorkersDepartedError
    from elastic.worker import nccl
    clock, abandoned = _Clock(), []
    flags = iter([False, False, True])
    with pytest.raises(WorkersDepartedError, match="aborted"):
        nccl.wait_polling(_NcclLikeWork(ready_after=10**9), 0.01, 10, lambda: next(flags),
                          clock=clock, sleep=clock.sleep, on_abandon=lambda: abandoned.append(1))
    with pytest.raises(WorkersDepartedError, match="timed out"):
        nccl.wait_polling(_NcclLikeWork(ready_after=10**9), 0.5, 2, lambda: False,
                          clock=clock, sleep=clock.sleep, on_abandon=lambda: abandoned.append(2))
    assert abandoned == [1, 2]
    with pytest.raises(WorkersDepartedError, match="remote process exited"):
        nccl.wait_polling(_NcclLikeWork(0, fail="NCCL error: remote process exited"), 0.01, 10,
                          lambda: False, clock=clock, sleep=clock.sleep)


def test_abort_uses_what_the_group_offers():
    from elastic.worker import nccl

    class Group:
        calls = []

        def abort(self):
            self.calls.append("abort")

    assert nccl.abort(Group()) and Group.calls == ["abort"]
    assert not nccl.abort(object())


def test_no_nccl_in_this_build_is_a_placement_error():
    from elastic.worker import nccl
    if nccl.available():
        pytest.skip("this torch build has NCCL")
    with pytest.raises(PlacementError, match="no NCCL"):
        nccl.new_group(None, 0, 1, 0, 5.0)


# -- a repeating error in a real job: reported once, never retried -----------------------------
@pytest.mark.slow
def test_a_backend_this_machine_lacks_fails_the_job_once_with_one_line(tmp_path):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from support.jobs import Job
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: ELASTIC_BACKEND=nccl is valid here")
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:2"], env={"ELASTIC_BACKEND": "nccl"})
    code = job.run()
    out = job.output()
    assert code != 0, out
    line = "elastic: error: ELASTIC_BACKEND=nccl but this torch build sees no CUDA device"
    assert sum(1 for x in out.splitlines() if "<stderr>:" in x and line in x) == 2, out  # once per worker
    assert "Traceback" not in out, out
    assert "restoring the last commit" not in out and not job.steps(), out   # no retry
