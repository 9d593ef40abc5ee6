"""torch.distributed inside an elastic job: the round as the default group, the
torchrun variables, and elastic.DDP across a SIGKILL, a scale-up and a graceful
removal, against the fixed-world math of the same script (tests/workloads/ddp_job.py).

One job serves most checks (each multi-process job costs seconds): its world goes
3 -> 2 (SIGKILL mid-backward) -> 3 (a host added) -> 2 (that host removed).
"""

import json
import time

import pytest
import torch
from support.harness import Workers
from support.jobs import REPO, Job, sizes_in_order

import elastic
from elastic.worker import torch_world

DDP_JOB = REPO / "tests" / "workloads" / "ddp_job.py"
STEPS = 8
SAMPLES = 24


def fixed_world_params(batches):
    """The parameters a fixed world reaches on these global batches: any world size
    computes the mean gradient over each batch's G samples, so one process does too
    (the workload's data, model and optimizer, built the same way)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 1)).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def run_changing(tmp_path):
    env = {"DDP_STEPS": str(STEPS), "DDP_KILL": "3:2", "DDP_HOLD": "5,6"}
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "--max-np", "3"],
              hosts=["localhost:2", "127.0.0.1:1"], env=env, script=DDP_JOB).start()
    job.wait_step(5, size=2)                               # rank 2 was killed at step 3
    job.set_hosts(["localhost:2", "127.0.0.2:1"])           # scale up at step 5's commit
    job.wait_step(6, size=3)
    job.set_hosts(["localhost:2"])                          # graceful removal at step 6
    assert job.finish() == 0, job.output()[-4000:]
    return job


@pytest.fixture(scope="module")
def changing(tmp_path_factory):
    return run_changing(tmp_path_factory.mktemp("ddp_changing"))


def finals(job):
    out = [json.loads(p.read_text()) for p in sorted(job.out.glob("final.*.json"))]
    assert len(out) == out[0]["size"], out
    for key in ("digest", "optimizer", "sampler", "batches", "step"):
        assert len({json.dumps(f[key]) for f in out}) == 1, key    # ranks bitwise equal
    return out[0]


def contracts(job):
    return [(r, r["contract"]) for r in job.steps() if "contract" in r]


def test_ddp_job_matches_a_fixed_world_run_across_kill_scale_up_and_removal(changing):
    assert sizes_in_order(changing.steps())[-3:] == [2, 3, 2]
    a = finals(changing)
    assert a["step"] == STEPS and a["size"] == 2
    # Exactly once: each epoch's global batches cover every sample once.
    per_epoch = SAMPLES // len(a["batches"][0])
    for start in range(0, len(a["batches"]), per_epoch):
        epoch = [i for batch in a["batches"][start:start + per_epoch] for i in batch]
        assert sorted(epoch) == list(range(SAMPLES))
    # The same math as a fixed world, up to summation order.
    got = torch.tensor([v for p in a["params"] for v in p], dtype=torch.float64)
    want = fixed_world_params(a["batches"])
    assert float((got - want).norm() / want.norm()) < 1e-9
    # Not trivially equal: training moved the parameters.
    assert float((want - fixed_world_params([])).norm() / want.norm()) > 1e-2
    # DDP was built on each new round's group.
    assert max(r["rebinds"] for r in changing.steps()) >= 2
    assert "killed" in {p.name for p in changing.out.iterdir()}


def test_every_round_is_torchs_default_group_with_torchrun_variables(changing):
    checked = contracts(changing)
    assert len({r["round"] for r, _ in checked}) >= 4
    for record, c in checked:
        size, rank = record["size"], record["rank"]
        assert c["initialized"] and (c["dist_rank"], c["dist_size"]) == (rank, size)
        assert c["backend"] == "gloo"
        assert c["env"]["RANK"] == str(rank) and c["env"]["WORLD_SIZE"] == str(size)
        assert int(c["env"]["LOCAL_RANK"]) < int(c["env"]["LOCAL_WORLD_SIZE"])
        assert c["env"]["GROUP_RANK"] is not None and c["env"]["MASTER_PORT"] != "0"
        assert c["all_reduce"] == [float(size)] * 2
        assert c["subgroup"] == size * (size + 1) / 2          # dist.new_group works
        assert c["gathered"] == list(range(size))
    # After a change, a collective on the ended round's group raised at once.
    later = [c["ended_group"] for r, c in checked if c["ended_group"] is not None]
    assert later and set(later) == {"WorkersDepartedError"}


def overlaps(order):
    """A bucket's reduction launched ("L") before backward's last gradient ("G")."""
    return "L" in order and "G" in order and order.index("L") < order.rindex("G")


def test_overlaps_detects_only_a_launch_before_the_last_gradient():
    assert overlaps("GGLGLL") and overlaps("LG")
    assert not overlaps("GGGLLLL") and not overlaps("GGG") and not overlaps("LLL")


def test_fp16_compression_hook_bucketing_and_overlap_across_a_change(tmp_path):
    """torch's fp16 hook through elastic.DDP: ranks stay bitwise equal across a scale-up,
    and in every step, before and after the change (DDP rebuilt on the new round's
    group), DDP launched several buckets, the first while backward was still computing
    the first layer's gradient: bucketing and overlap (by order, not by time)."""
    env = {"DDP_STEPS": "4", "DDP_HOLD": "2", "DDP_HOOK": "fp16"}
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3"],
              hosts=["localhost:2"], env=env, script=DDP_JOB).start()
    job.wait_step(2)
    job.set_hosts(["localhost:3"])
    assert job.finish() == 0, job.output()[-4000:]
    assert sizes_in_order(job.steps()) == [2, 3]
    assert finals(job)["step"] == 4
    steps = job.steps()
    firsts = {(r["worker"], r["round"]): r["step"] for r in sorted(steps, key=lambda r: -r["step"])}
    later = [r for r in steps if firsts[r["worker"], r["round"]] != r["step"]]
    # torch's DDP reduces its first iteration in one bucket and then builds its buckets
    # in the order gradients arrived: each round's DDP is new, so skip its first step.
    assert {r["size"] for r in later} == {2, 3}
    for r in later:
        # 4 parameters, a bucket each (bucket_cap_mb=1e-6); the micro-batches before
        # the last accumulate (no_sync) and launch none: one synchronised backward's.
        assert r["order"].count("L") == 4, r
        assert overlaps(r["order"]), r


def test_outside_elasticrun_ddp_is_the_module_and_no_group_is_installed():
    elastic.init()
    net = torch.nn.Linear(3, 1)
    model = elastic.DDP(net)
    x = torch.randn(4, 3)
    assert torch.equal(model(x), net(x))
    assert model.ddp is None and torch_world.current() is None
    with model.no_sync():
        model(x).sum().backward()
    assert list(model.state_dict()) == ["module.weight", "module.bias"]


def test_blocked_user_collectives_raise_when_the_round_is_aborted(tmp_path):
    """A hung peer (SIGSTOP) keeps its connections open, so gloo would wait for the group
    timeout (600 s here); the round's abort ends a user's dist.all_reduce and DDP's
    backward at once, each as an error @elastic.run counts as a departure."""
    out = tmp_path / "marks"
    out.mkdir()
    with Workers(REPO / "tests" / "workloads" / "hung_peer.py", 2, tmp_path,
                 extra_env={"HUNG_OUT": str(out), "ELASTIC_COLLECTIVE_TIMEOUT": "600"},
                 timeout=240) as w:
        w.wait_for(lambda: (out / "stopping").exists() and (out / "blocking.0").exists(),
                   "rank 1 to stop and rank 0 to block on it")
        w.abort(1)
        deadline = time.monotonic() + 120
        while w.procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        w.kill()
        lines = [line for line in (tmp_path / "w0.out").read_text().splitlines()
                 if line.startswith("{")]
    assert lines, w.logs()
    result = json.loads(lines[-1])
    assert result["all_reduce"] == "WorkersDepartedError explained=False", result  # caught as is
    assert result["ddp_backward"].endswith("explained=True"), result
