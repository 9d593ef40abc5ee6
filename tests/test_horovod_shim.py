"""A Horovod-style elastic script runs under elasticrun with only its import changed."""

import json
import os

import pytest
import torch
from support.jobs import REPO, Job

import elastic.torch as hvd

HORovod_NAMES = [
    "init", "rank", "size", "local_rank", "local_size", "cross_rank", "DistributedOptimizer",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allreduce",
    "allgather", "Compression", "HorovodInternalError", "HostsUpdatedInterrupt",
]


def test_shim_exposes_horovod_names():
    for name in HORovod_NAMES:
        assert hasattr(hvd, name), name
    for name in ("run", "TorchState", "ObjectState", "ElasticSampler"):
        assert hasattr(hvd.elastic, name), name
    assert hvd.HorovodInternalError is __import__("elastic").WorkersDepartedError
    hvd.init()
    assert torch.equal(hvd.allreduce(torch.ones(3), average=False), torch.ones(3))
    assert torch.equal(hvd.allreduce(torch.ones(3), op=hvd.Sum, postscale_factor=2.0),
                       torch.full((3,), 2.0))


@pytest.mark.slow
def test_horovod_style_script_survives_crash_and_scale_up(tmp_path):
    job = Job(tmp_path, ["--num-proc", "2", "--min-num-proc", "1", "--max-num-proc", "3",
                         "--blacklist-cooldown-range", "60", "60"],
              hosts=["localhost:1", "127.0.0.1:1"],
              script=REPO / "tests" / "workloads" / "hvd_style.py").start()
    # rank 1 crashes at batch 4; then the job holds at batch 8 until we add a host.
    job.wait_for(lambda: (job.out / "crashed").exists() and "round 2:" in job.output(),
                 "the crash to be handled")
    job.set_hosts(["localhost:1", "127.0.0.1:1", job_third_host()])
    job.wait_for(lambda: "round 3:" in job.output(), "the scale-up")
    (job.out / "go").write_text("go")
    assert job.finish() == 0, job.output()[-3000:]
    result = json.loads((job.out / "result.json").read_text())
    assert result == {"size": 2, "equal": True}
    sizes = [int(x) for p in job.out.glob("sizes.*.txt") for x in p.read_text().split()]
    assert {1, 2} <= set(sizes)


def job_third_host():
    import socket
    return f"{socket.gethostname()}:1"


def test_horovod_environment_aliases_exported(monkeypatch):
    from elastic.worker import runtime
    monkeypatch.setattr(os, "environ", dict(os.environ))
    runtime.Membership(rank=3, size=4, hostname="h").export()
    assert os.environ["HOROVOD_RANK"] == "3" and os.environ["HOROVOD_SIZE"] == "4"
    assert os.environ["HOROVOD_HOSTNAME"] == "h"
