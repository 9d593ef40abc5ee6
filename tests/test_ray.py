"""elastic.ray.RayExecutor on a real local Ray cluster (several raylets on this machine).

One cluster serves every test of this module (Ray starts slowly on 2 cores):
a head node without CPUs (so no worker lands there) and 1-CPU nodes, each of
which becomes one host of one slot. Each test runs tests/workloads/train_job.py
as the function, so the same files tell what happened as in the elasticrun tests.
"""

import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from support.jobs import assert_exactly_once, sizes_in_order

ray = pytest.importorskip("ray", reason="ray is not installed (make install adds it)")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from elastic.ray import RayExecutor  # noqa: E402

WORKLOADS = Path(__file__).resolve().parent / "workloads"
pytestmark = pytest.mark.slow


def train_job(out):
    """The elasticrun test workload, as a function; returns where and what it finished as."""
    import elastic
    sys.path.insert(0, str(WORKLOADS))
    os.environ["JOB_OUT"] = out
    runpy.run_path(str(WORKLOADS / "train_job.py"), run_name="__main__")
    return {"rank": elastic.rank(), "size": elastic.size(),
            "host": os.environ["ELASTIC_HOSTNAME"]}


@pytest.fixture(scope="module")
def cluster():
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    c.wait_for_nodes()
    yield c, nodes
    ray.shutdown()
    c.shutdown()


class Running:
    """RayExecutor.run in a thread, watched through the workload's files."""

    def __init__(self, out, executor):
        self.out = Path(out)
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(executor,), daemon=True)
        self.thread.start()

    def _run(self, executor):
        try:
            self.result = executor.run(train_job, args=(str(self.out),))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            self.error = exc

    def steps(self):
        records = []
        for path in self.out.glob("steps.*.jsonl"):
            records += [json.loads(line) for line in path.read_text().splitlines() if line]
        return records

    def wait_for(self, predicate, what, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if not self.thread.is_alive():
                raise AssertionError(f"the job ended before {what}: {self.error!r}")
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_step(self, step, size):
        self.wait_for(lambda: any(r["step"] >= step and r["size"] == size
                                  for r in self.steps()), f"step {step} at size {size}")

    def release(self, step):
        (self.out / f"go.{step}").write_text("go")

    def finish(self, timeout=240):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "RayExecutor.run hung"
        if self.error is not None:
            raise self.error
        return self.result


def _executor(**kw):
    return RayExecutor(min_np=1, max_np=4, cpus_per_worker=1, np=2, worker_timeout=5,
                       watch_interval=0.5, env={"OMP_NUM_THREADS": "1", "JOB_HOLD": kw.pop(
                           "hold")}, **kw)


def test_a_node_added_grows_the_job_and_a_node_removed_shrinks_it(cluster, tmp_path):
    c, _ = cluster
    job = Running(tmp_path, _executor(hold="3,6"))
    job.wait_step(3, size=2)
    extra = c.add_node(num_cpus=1)                     # the autoscaler adds a node
    job.wait_for(lambda: any(r["size"] == 3 for r in job.steps()), "the job to grow to 3")
    job.release(3)
    job.wait_step(6, size=3)
    c.remove_node(extra)                               # ... and takes it away again
    job.release(6)
    results = job.finish()
    assert [r["rank"] for r in results] == [0, 1] and {r["size"] for r in results} == {2}
    sizes = sizes_in_order(job.steps())
    assert 3 in sizes and sizes[-1] == 2, sizes
    assert len({r["host"] for r in job.steps()}) == 3
    assert_exactly_once(json.loads((tmp_path / "history.json").read_text()), 3, 48)
    finals = [json.loads(p.read_text()) for p in tmp_path.glob("final.*.json")]
    assert len({json.dumps(f["params"]) for f in finals}) == 1


def test_a_sigkilled_actor_is_a_failed_host_and_the_job_goes_on(cluster, tmp_path, capfd):
    executor = _executor(hold="3")
    job = Running(tmp_path, executor)
    job.wait_step(3, size=2)
    actor = next(iter(executor.agents().values()))
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
    job.release(3)
    results = job.finish()
    assert [r["size"] for r in results] == [1]
    assert "blacklisting host ray-" in capfd.readouterr().err
    assert_exactly_once(json.loads((tmp_path / "history.json").read_text()), 3, 48)


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(ValueError):
        RayExecutor(min_np=1, cpus_per_worker=-1)
    with pytest.raises(TypeError):
        RayExecutor(min_np=1, no_such_flag=3)
    # elasticrun's own checks (JobConfig.from_options), as elastic.launch and the CLI make them
    with pytest.raises(ValueError, match="^elasticrun: -np 3 is larger than --max-np 2$"):
        RayExecutor(min_np=3, max_np=2)
    with pytest.raises(ValueError, match="--elastic-timeout must be a positive number"):
        RayExecutor(min_np=1, elastic_timeout=-1)
