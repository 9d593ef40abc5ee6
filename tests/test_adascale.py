"""AdaScale (LRScaler(rule="adascale")): the gain estimate, training at 1, 2 and 4
workers simulated in one process, the state through commit/restore/checkpoints, and a
real elasticrun job whose world goes 4 -> 2 -> 3.

The training problem (tests/workloads/adascale_problem.py) is least squares on sampled
data; "loss" is the excess over the optimum, known exactly from the weights.
"""

import importlib.util
import json
import math
import socket

import pytest
import torch
from support.jobs import REPO, Job, sizes_in_order

import elastic
from elastic.training.adascale import GainEstimator, smoothing
from elastic.training.lr_scaling import LRScaler, scale_factor

slow = pytest.mark.slow

_spec = importlib.util.spec_from_file_location(
    "adascale_problem", REPO / "tests" / "workloads" / "adascale_problem.py")
problem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(problem)


def true_gain(var, sqr, scale):
    """The paper's r at scale S for one batch's gradient variance var and |grad F|^2 sqr."""
    return (var + sqr) / (var / scale + sqr)


def synthetic_step(gen, mean, var, workers, passes):
    """Each worker's local gradient is the mean of ``passes`` gradients mean + noise, the
    noise with E|noise|^2 = var. Returns (sum of the local squared norms, |their mean|^2)."""
    d = mean.numel()
    noise = torch.randn(workers, passes, d, generator=gen, dtype=torch.float64)
    local = mean + noise.mul(math.sqrt(var / d)).mean(dim=1)
    g = local.mean(dim=0)
    return float((local * local).sum()), float(g @ g)


# ---------------------------------------------------------------- the estimate

@pytest.mark.parametrize("workers,passes,base", [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1),
                                                 (4, 1, 2)])
@pytest.mark.parametrize("var,sqr", [(4.0, 1.0), (1.0, 3.0), (9.0, 0.25)])
def test_gain_converges_to_the_true_ratio(workers, passes, base, var, sqr):
    """Synthetic gradients with a set variance: after a few thousand steps the estimated
    gain is within 3 % of (var + sqr) / (var / S + sqr), S = workers x passes / base."""
    gen = torch.Generator().manual_seed(workers * 10 + passes + base)
    mean = torch.randn(64, generator=gen, dtype=torch.float64)
    mean *= math.sqrt(sqr) / mean.norm()
    est = GainEstimator(base_size=base)
    for _ in range(3000):
        est.observe(*synthetic_step(gen, mean, var, workers, passes), workers, passes)
    gain = est.gain(workers, passes)
    expected = true_gain(var / base, sqr, workers * passes / base)
    if workers == 1:
        assert est.observations == 0 and gain == 1.0 == expected   # nothing to compare
        return
    assert gain == pytest.approx(expected, rel=0.03), (gain, expected)
    got_var, got_sqr = est.estimates()
    assert got_var == pytest.approx(var, rel=0.05)
    assert got_sqr == pytest.approx(sqr, abs=0.02 * (var + sqr))


def test_estimates_carry_over_to_a_new_scale():
    """Estimated at 4 workers, the gain at 2 and 3 workers is right at once, without new
    observations; a step at one worker leaves the averages alone."""
    gen = torch.Generator().manual_seed(5)
    var, sqr = 6.0, 1.5
    mean = torch.randn(32, generator=gen, dtype=torch.float64)
    mean *= math.sqrt(sqr) / mean.norm()
    est = GainEstimator()
    for _ in range(2000):
        est.observe(*synthetic_step(gen, mean, var, 4, 1), 4)
    before = est.state_dict()
    for workers in (2, 3, 8):
        assert est.gain(workers) == pytest.approx(true_gain(var, sqr, workers), rel=0.03)
    assert est.gain(1) == 1.0
    assert not est.observe(*synthetic_step(gen, mean, var, 1, 1), 1)
    assert not est.observe(float("inf"), 1.0, 4)        # an overflowed step is skipped
    assert est.state_dict() == before
    for _ in range(500):
        est.observe(*synthetic_step(gen, mean, var, 2, 1), 2)   # continues, not restarted
    assert est.observations == 2500
    assert est.gain(2) == pytest.approx(true_gain(var, sqr, 2), rel=0.03)
    assert smoothing(2) == pytest.approx(0.998) and smoothing(4000) == 0.0


# ---------------------------------------------------------------- training, simulated

@pytest.fixture(scope="module")
def single_worker():
    """One worker's mean loss curve over six seeds, and the target: its loss at
    TARGET_AT scale-invariant iterations (after the decay)."""
    curve = problem.mean_curve([problem.simulate(1, "adascale", s)[0] for s in range(6)])
    target = curve[problem.TARGET_AT]
    return curve, target, problem.first_below(curve, target)


@pytest.mark.parametrize("workers", [2, 4])
def test_adascale_reaches_the_target_like_one_worker(single_worker, workers):
    """Within 10 % of one worker's scale-invariant iterations, in fewer steps."""
    _, target, reference = single_worker
    runs = [problem.simulate(workers, "adascale", 100 + s) for s in range(6)]
    curve = problem.mean_curve([c for c, _ in runs])
    reached = problem.first_below(curve, target)
    assert reached is not None, curve[-20:]
    assert abs(reached / reference - 1) <= 0.10, (reached, reference)
    steps = sum(scaler.steps for _, scaler in runs) / len(runs)
    assert steps < problem.TOTAL * (0.75 if workers == 2 else 0.5), steps   # the speed-up
    for _, scaler in runs:
        assert 1.0 < scaler.gain <= workers


def test_the_linear_rule_at_the_same_lr_diverges_or_misses(single_worker):
    _, target, reference = single_worker
    curve, _ = problem.simulate(4, "linear", 100)
    reached = problem.first_below(curve, target)
    assert reached is None or reached > 1.10 * reference, (reached, reference, curve[-1])


def test_one_worker_is_plain_sgd(single_worker):
    """At one worker the gain is 1 and progress counts steps: the reference is SGD."""
    curve, scaler = problem.simulate(1, "adascale", 0)
    assert scaler.gain == 1.0 and scaler.progress == scaler.steps == problem.TOTAL


# ---------------------------------------------------------------- the scaler

def _make():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _feed(scaler, model, opt, gen, workers, steps=50):
    for _ in range(steps):
        opt.zero_grad()
        local = 1.0 + 2.0 * torch.randn(workers, 3, generator=gen, dtype=torch.float64)
        model.weight.grad = local.mean(0).reshape(1, 3).clone()
        scaler.observe(float((local * local).sum()), float(local.mean(0).pow(2).sum()))
        opt.step()


def test_lr_is_the_schedule_times_the_gain_and_drive_steps_on_progress():
    model, opt = _make()
    world = [4]
    scaler = LRScaler(opt, base_size=1, rule="adascale", size_fn=lambda: world[0])
    sched = scaler.drive(torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5))
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    gen = torch.Generator().manual_seed(1)
    progress = 0.0
    for _ in range(30):
        before = scaler.progress
        _feed(scaler, model, opt, gen, world[0], steps=1)
        assert scaler.progress == pytest.approx(before + scaler.gain)
        assert seen[-1] == pytest.approx(0.1 * 0.5 ** int(before // 10) * scaler.gain)
        assert sched.last_epoch == int(scaler.progress)
        assert opt.param_groups[0]["lr"] == 0.1 * 0.5 ** (int(scaler.progress) // 10)
        progress += scaler.gain
    assert scaler.progress == pytest.approx(progress) and scaler.steps == 30
    assert 1.0 < scaler.gain < 4.0 and scaler.scaled_lrs()[0] == pytest.approx(
        opt.param_groups[0]["lr"] * scaler.gain)
    world[0] = 2                                  # a membership change: the reset callback
    gain4, estimates = scaler.gain, scaler.estimator.estimates()
    scaler()
    assert 1.0 < scaler.gain < gain4 and scaler.estimator.estimates() == estimates


def test_state_commits_restores_and_checkpoints(tmp_path):
    model, opt = _make()
    scaler = LRScaler(opt, base_size=1, rule="adascale", size_fn=lambda: 4)
    sched = scaler.drive(torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5))
    ck = elastic.Checkpointer(tmp_path / "ck", every_commits=1)
    state = elastic.TorchState(model, opt, elastic_checkpoint=ck, scaler=scaler, sched=sched)
    state.sync()
    gen = torch.Generator().manual_seed(2)
    _feed(scaler, model, opt, gen, 4, steps=20)
    state.commit()
    assert ck.wait(60)
    committed = scaler.state_dict()
    assert committed["estimator"]["observations"] == 20 and committed["progress"] > 20
    _feed(scaler, model, opt, gen, 4, steps=7)
    assert scaler.state_dict() != committed
    state.restore()
    assert scaler.state_dict() == committed and sched.last_epoch == int(committed["progress"])
    ck.close()

    model2, opt2 = _make()
    scaler2 = LRScaler(opt2, base_size=1, rule="adascale", size_fn=lambda: 4)
    sched2 = scaler2.drive(torch.optim.lr_scheduler.StepLR(opt2, step_size=5, gamma=0.5))
    ck2 = elastic.Checkpointer(tmp_path / "ck")
    state2 = elastic.TorchState(model2, opt2, elastic_checkpoint=ck2, scaler=scaler2,
                                sched=sched2)
    state2.sync()                                  # a new job resumes from the checkpoint
    assert scaler2.state_dict() == committed and scaler2.gain == scaler.gain
    assert sched2.last_epoch == sched.last_epoch
    ck2.close()


def test_distributed_optimizer_feeds_it_and_accumulation_counts():
    """Standalone (one worker) the optimizer's observer has no peers to compare: the
    estimates stay empty and the gain 1; the scale counts backward_passes_per_step."""
    model, opt = _make()
    dopt = elastic.DistributedOptimizer(opt, backward_passes_per_step=2)
    scaler = LRScaler(dopt, base_size=1, rule="adascale")
    assert dopt.gradient_observer is not None and scaler.passes() == 2
    for _ in range(3):
        dopt.zero_grad()
        for _ in range(2):
            model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
        dopt.step()
    assert scaler.steps == 3 and scaler.gain == 1.0 and scaler.estimator.observations == 0
    scaler.remove()
    assert dopt.gradient_observer is None
    assert LRScaler(dopt, base_size=1, rule="adascale", accumulation=3).passes() == 3


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_the_optimizer_hook_sees_local_and_reduced_norms_one_step_late(compression):
    """Through a DistributedOptimizer (standalone: the reduction is the identity, so the
    local and reduced gradients are equal): each measured step's squared norm arrives at
    the next step, over several buckets; steps not measured send nothing."""
    from elastic.training.adascale import GradientNorms
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    dopt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        compression=getattr(elastic.Compression, compression),
                                        bucket_cap_mb=5e-5)
    seen, step = [], [0]
    dopt.gradient_observer = GradientNorms(lambda *a: seen.append(a), lambda: step[0] % 2 == 0)
    expected = []
    for _ in range(6):
        dopt.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        dopt.step()
        sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
        expected.append(sq)
        step[0] += 1
    assert dopt.bucket_count > 1
    assert [a[2] for a in seen] == [1, 1, 1]            # steps 0, 2 and 4, seen at 1, 3 and 5
    tol = 1e-6 if compression == "none" else 2e-3
    for (local, reduced, _), want in zip(seen, expected[::2], strict=True):
        assert local == pytest.approx(want, rel=tol) and reduced == pytest.approx(want, rel=tol)


def test_measuring_every_nth_step_keeps_the_horizon():
    gen = torch.Generator().manual_seed(9)
    mean = torch.randn(16, generator=gen, dtype=torch.float64)
    every, sparse = GainEstimator(), GainEstimator()
    for i in range(4000):
        sample = synthetic_step(gen, mean, 5.0, 2, 1)
        every.observe(*sample, 2)
        if i % 4 == 0:
            sparse.observe(*sample, 2, interval=4)
    assert sparse.observations == 1000
    assert sparse.gain(2) == pytest.approx(every.gain(2), rel=0.03)
    assert sparse.gain(2) == pytest.approx(true_gain(5.0, float(mean @ mean), 2), rel=0.04)
    with pytest.raises(ValueError, match="measure_every"):
        LRScaler(_make()[1], base_size=1, rule="adascale", measure_every=0)


def test_bad_input():
    _, opt = _make()
    with pytest.raises(ValueError, match="adascale"):
        scale_factor(2, 1, "adascale")
    linear = LRScaler(opt, base_size=1, rule="linear", size_fn=lambda: 2)
    with pytest.raises(ValueError, match="observe"):
        linear.observe(1.0, 1.0)
    with pytest.raises(TypeError, match="scheduler"):
        linear.drive(object())
    linear.remove()
    with pytest.raises(ValueError):
        LRScaler(opt, base_size=0, rule="adascale")


# ---------------------------------------------------------------- a real job, 4 -> 2 -> 3

THIRD_HOST = socket.gethostname()
WORKLOAD = REPO / "tests" / "workloads" / "adascale_train.py"
HOLDS = (40, 90)


@pytest.fixture(scope="module")
def elastic_job(tmp_path_factory):
    """Four workers until step 40, two until step 90, then three, to TOTAL iterations."""
    job = Job(tmp_path_factory.mktemp("adascale"), ["-np", "4", "--min-np", "2", "--max-np", "4"],
              hosts=["localhost:2", "127.0.0.1:2"], script=WORKLOAD,
              env={"ADA_HOLD": ",".join(map(str, HOLDS))}).start()
    job.wait_step(HOLDS[0])
    job.set_hosts(["127.0.0.1:2"])                      # 4 -> 2 at the commit of step 40
    job.wait_step(HOLDS[0] + 1, size=2)
    job.wait_step(HOLDS[1])
    job.set_hosts(["127.0.0.1:2", f"{THIRD_HOST}:1"])    # 2 -> 3 at the commit of step 90
    job.wait_step(HOLDS[1] + 1, size=3)
    assert job.finish() == 0, job.output()[-4000:]
    return job, by_step(job)


def by_step(job):
    steps = {}
    for r in job.steps():
        steps.setdefault(r["step"], {})[r["rank"]] = r
    return [steps[s] for s in sorted(steps)]


def check_gains_and_progress(steps, passes=1):
    """Every rank agrees at every step; each gain equals one recomputed from the workers'
    own gradient norms; progress is the sum of the gains. Returns the estimator."""
    est, progress, previous = GainEstimator(), 0.0, None
    for ranks in steps:
        first = ranks[0]
        for r in ranks.values():          # every rank, newcomers included, agrees
            assert (r["progress"], r["gain"], r["observations"]) == (
                first["progress"], first["gain"], first["observations"]), ranks
        # The gain follows from the norms the workers saw, through the optimizer's buckets
        # and its scalar allreduce: recompute it from each rank's own local gradient. A
        # step's norms count from the next step on, within its round.
        if previous is not None and previous[0]["round"] == first["round"]:
            est.observe(sum(r["local_sq"] for r in previous.values()),
                        previous[0]["reduced_sq"], previous[0]["size"], passes)
        assert first["gain"] == pytest.approx(est.gain(first["size"], passes), rel=1e-9)
        assert 1.0 <= first["gain"] <= first["size"] * passes
        assert first["observations"] == est.observations      # never reset by a change
        progress += first["gain"]
        assert first["progress"] == pytest.approx(progress, rel=1e-12)
        previous = ranks
    return est


@slow
def test_elastic_run_keeps_progress_continuous(elastic_job):
    job, steps = elastic_job
    assert sizes_in_order(job.steps()) == [4, 2, 3]
    assert [len(ranks) for ranks in steps] == [
        4 if s <= HOLDS[0] else 2 if s <= HOLDS[1] else 3 for s in range(1, len(steps) + 1)]
    est = check_gains_and_progress(steps)
    assert est.observations == len(steps) - 3     # the last step of each round is dropped
    finals = [json.loads(p.read_text()) for p in job.out.glob("final.*.json")]
    assert len(finals) == 3 and len({json.dumps(f["scaler"]) for f in finals}) == 1
    assert finals[0]["progress"] >= problem.TOTAL > steps[-2][0]["progress"]


@slow
def test_elastic_run_reaches_the_target_like_one_worker(elastic_job, single_worker):
    _, steps = elastic_job
    _, target, reference = single_worker
    reached = next((s[0]["progress"] for s in steps if s[0]["loss"] < target), None)
    assert reached is not None, steps[-1][0]
    assert abs(reached / reference - 1) <= 0.10, (reached, reference)
    assert len(steps) < 0.6 * problem.TOTAL                  # in fewer steps than one worker


@slow
def test_ddp_with_accumulation(tmp_path):
    """Two workers reducing through elastic.DDP and the scaler's comm hook, two backward
    passes per step (no_sync): S = 4, and the gains follow from the norms as above.
    (The workload runs a DistributedOptimizer with backward_passes_per_step=k the
    same way with ADA_DDP=0; one job here keeps the suite short.)"""
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:2"], script=WORKLOAD,
              env={"ADA_DDP": "1", "ADA_PASSES": "2", "ADA_TOTAL": "30"})
    assert job.run() == 0, job.output()[-4000:]
    steps = by_step(job)
    assert all(len(ranks) == 2 for ranks in steps)
    est = check_gains_and_progress(steps, passes=2)
    assert est.observations == len(steps) - 1 and len(steps) < 20
    assert 1.5 < steps[-1][0]["gain"] < 4.0
    assert steps[-1][0]["loss"] < 0.2 * steps[0][0]["loss"]
