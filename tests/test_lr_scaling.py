"""Tests for elastic.lr_scaling.LRScaler: rules, schedulers, resets and failures."""

import math

import pytest
import torch

import elastic
from elastic.training.lr_scaling import LRScaler, scale_factor


class World:
    """A world size the test sets by hand, read by the scaler through size_fn."""

    def __init__(self, size):
        self.size = size

    def __call__(self):
        return self.size


def make(lrs=(0.1, 0.03), momentum=0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    groups = [{"params": m.parameters(), "lr": lr} for m, lr in zip(model, lrs)]
    return model, torch.optim.SGD(groups, lr=lrs[0], momentum=momentum)


def step(model, opt):
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()


def recorder(opt):
    """The lrs the optimizer really uses: a pre-hook registered after the scaler's."""
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append([g["lr"] for g in o.param_groups]))
    return seen


def test_rules():
    assert scale_factor(2, 4, "linear") == 0.5
    assert scale_factor(8, 4, "linear") == 2.0
    assert scale_factor(2, 8, "sqrt") == pytest.approx(0.5)
    assert scale_factor(4, 4, "sqrt") == 1.0 and scale_factor(4, 4, "linear") == 1.0
    assert scale_factor(7, 4, "none") == 1.0
    assert scale_factor(3, 4, lambda s: s ** 2) == pytest.approx(9 / 16)
    with pytest.raises(ValueError, match="unknown lr scaling rule"):
        scale_factor(2, 4, "cubic")
    with pytest.raises(ValueError, match=">= 1"):
        scale_factor(0, 4)


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_applies_to_all_groups_only_during_step(rule):
    model, opt = make()
    world = World(2)
    scaler = LRScaler(opt, base_size=4, rule=rule, size_fn=world)
    seen = recorder(opt)
    factor = 0.5 if rule == "linear" else math.sqrt(0.5)
    step(model, opt)
    assert seen[-1] == [0.1 * factor, 0.03 * factor]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.03]   # unscaled between steps
    assert scaler.scaled_lrs() == [0.1 * factor, 0.03 * factor]
    assert scaler.factor == factor and scaler.size == 2


def test_the_update_uses_the_scaled_lr():
    model, opt = make(momentum=0.0)
    ref_model, ref_opt = make(lrs=(0.3, 0.09))
    LRScaler(opt, base_size=2, rule="linear", size_fn=World(6))
    step(model, opt)
    step(ref_model, ref_opt)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_many_resets_do_not_drift():
    model, opt = make()
    world = World(4)
    scaler = LRScaler(opt, base_size=4, rule="sqrt", size_fn=world)
    state = elastic.ObjectState(step=0)
    state.register_reset_callbacks([scaler])      # the one-line registration
    seen = recorder(opt)
    step(model, opt)
    original = seen[-1]
    assert original == [0.1, 0.03]
    for _cycle in range(200):
        for size in (2, 3, 4):
            world.size = size
            state.on_reset()
            assert scaler.size == size
            step(model, opt)
        assert seen[-1] == original                # bit for bit, after every 4->2->3->4
        assert [g["lr"] for g in opt.param_groups] == [0.1, 0.03]
    assert seen[-2] == [lr * scale_factor(3, 4, "sqrt") for lr in original]


def _schedulers(opt, kind):
    sched = torch.optim.lr_scheduler
    if kind == "warmup_cosine":
        warm = sched.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 4))
        cos = sched.CosineAnnealingLR(opt, T_max=10, eta_min=0.001)
        return sched.SequentialLR(opt, [warm, cos], milestones=[4])
    if kind == "lambda":
        return sched.LambdaLR(opt, lambda e: 1.0 / (1 + e))
    if kind == "step":
        return sched.StepLR(opt, step_size=3, gamma=0.5)
    if kind == "onecycle":
        return sched.OneCycleLR(opt, max_lr=[0.2, 0.06], total_steps=40)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["warmup_cosine", "lambda", "step", "onecycle"])
@pytest.mark.parametrize("wrap", [False, True])
def test_composes_with_schedulers(kind, wrap):
    """Effective lr = the lr an unscaled twin's scheduler sets x the factor, at every step."""
    model, opt = make()
    ref_model, ref_opt = make()
    world = World(4)
    if wrap:
        opt = elastic.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    scheduler = _schedulers(opt, kind)
    ref_scheduler = _schedulers(ref_opt, kind)
    LRScaler(opt, base_size=4, rule="linear", size_fn=world)
    seen, ref_seen = recorder(opt), recorder(ref_opt)
    sizes = [4, 4, 2, 2, 2, 3, 3, 4, 8, 1] * 3
    for size in sizes:
        world.size = size
        step(model, opt)
        step(ref_model, ref_opt)
        scheduler.step()
        ref_scheduler.step()
        factor = size / 4
        assert seen[-1] == [lr * factor for lr in ref_seen[-1]]
        # The scheduler only ever saw unscaled values: it stays in lockstep with the twin.
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert opt.state_dict()["param_groups"][0]["lr"] == ref_opt.state_dict()["param_groups"][0]["lr"]


def test_reduce_on_plateau_sees_unscaled_lr():
    model, opt = make()
    world = World(2)
    LRScaler(opt, base_size=4, rule="linear", size_fn=world)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    seen = recorder(opt)
    for _ in range(3):
        step(model, opt)
        plateau.step(1.0)
    assert [g["lr"] for g in opt.param_groups] == [0.1 * 0.25, 0.03 * 0.25]
    step(model, opt)
    assert seen[-1] == [0.1 * 0.25 * 0.5, 0.03 * 0.25 * 0.5]


def test_a_step_that_raises_does_not_compound():
    model, opt = make()
    world = World(2)
    LRScaler(opt, base_size=4, size_fn=world)
    seen = recorder(opt)
    model(torch.ones(1, 3)).sum().backward()

    def failing_closure():
        raise elastic.WorkersDepartedError("peer gone")

    with pytest.raises(elastic.WorkersDepartedError):
        opt.step(failing_closure)       # the post hook never runs
    step(model, opt)
    assert seen[-1] == [0.05, 0.015]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.03]
    # A restore (load_state_dict) after a failed step wins over the scaler's bookkeeping.
    saved = opt.state_dict()
    with pytest.raises(elastic.WorkersDepartedError):
        opt.step(failing_closure)
    saved["param_groups"][0]["lr"] = 0.2
    opt.load_state_dict(saved)
    step(model, opt)
    assert seen[-1] == [0.1, 0.015]
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.03]


def test_default_size_is_the_runtime_world_and_remove():
    model, opt = make()
    dopt = elastic.DistributedOptimizer(opt)
    scaler = LRScaler(dopt, base_size=4)               # standalone: size 1
    assert scaler.factor == 0.25 and scaler() == 0.25
    seen = recorder(opt)
    step(model, dopt)
    assert seen[-1] == [0.025, 0.0075]
    with pytest.raises(RuntimeError, match="already has an LRScaler"):
        LRScaler(opt, base_size=2)
    scaler.remove()
    step(model, dopt)
    assert seen[-1] == [0.1, 0.03]
    LRScaler(dopt, base_size=1)                        # may attach again once removed


def test_bad_arguments():
    _, opt = make()
    with pytest.raises(ValueError):
        LRScaler(opt, base_size=0)
    with pytest.raises(ValueError):
        LRScaler(opt, base_size=4, rule="log")
    assert not any(name.startswith("_elastic") for name in vars(opt))   # nothing written on it
