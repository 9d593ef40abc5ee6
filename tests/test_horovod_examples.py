"""Stand-ins for Horovod's PyTorch examples (pytorch_mnist_elastic.py,
pytorch_synthetic_benchmark_elastic.py, pytorch_imagenet_resnet50_elastic.py and plain
pytorch_mnist.py), written here with synthetic data: the same hvd calls with the same
keywords, only the import changed. Each runs under elasticrun on real gloo."""

import json

import pytest
from support.jobs import REPO, Job

EXAMPLES = REPO / "tests" / "workloads" / "hvd_examples"


def _reports(job, name):
    return [json.loads(p.read_text()) for p in sorted(job.out.glob(f"{name}.*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mnist", "mnist_elastic", "synthetic_benchmark_elastic"])
def test_example_trains_on_two_workers(tmp_path, name):
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:2"], script=EXAMPLES / f"{name}.py")
    assert job.run() == 0, job.output()[-3000:]
    reports = _reports(job, name)
    assert sorted(r["rank"] for r in reports) == [0, 1] and {r["size"] for r in reports} == {2}
    assert reports[0]["params"] == reports[1]["params"]   # the ranks stayed in step


@pytest.mark.slow
def test_imagenet_example_survives_a_crash(tmp_path):
    """Gradient accumulation, predivide, check_host_updates; rank 1 dies mid-epoch and the
    survivor trains on with rebuilt buckets (gradients are views into the new ones)."""
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "60", "60"],
              hosts=["localhost:1", "127.0.0.1:1"], env={"HVD_EXAMPLE_CRASH": "1"},
              script=EXAMPLES / "imagenet_resnet50_elastic.py")
    assert job.run() == 0, job.output()[-3000:]
    assert (job.out / "crashed.imagenet").exists()
    reports = _reports(job, "imagenet_resnet50_elastic")
    final = [r for r in reports if r["size"] == 1]
    assert final and all(r["views"] for r in final), reports
