"""The AdaScale tests' training problem: least squares on sampled data, shared by the
in-process simulation (tests/test_adascale.py) and the real job (adascale_train.py).

x ~ N(0, diag(LAM)) in D dimensions, y = x . 1 + N(0, NOISE^2); a worker's batch is
B samples; the loss is half the mean squared error. The excess loss over the optimum
is known exactly: 1/2 sum LAM (w - 1)^2. The curvatures span 1 down to 1e-3, so
with LR = 0.5 one worker is stable and the linear rule at 4 workers (lr 2.0) is not.
A StepLR decay by 10 at DECAY scale-invariant iterations, of TOTAL.
"""

import math

import torch

D, B, NOISE = 128, 16, 0.5
LAM = torch.logspace(0, -3, D, dtype=torch.float64)
LR, TOTAL, DECAY = 0.5, 400, 240
TARGET_AT = 280          # the target: one worker's mean loss at this many iterations


def batches(gen, count):
    """``count`` worker batches: x of shape (count, B, D), y of shape (count, B)."""
    x = torch.randn(count, B, D, generator=gen, dtype=torch.float64) * LAM.sqrt()
    y = x.sum(dim=2) + NOISE * torch.randn(count, B, generator=gen, dtype=torch.float64)
    return x, y


def excess_loss(weight):
    e = weight.detach().reshape(-1) - 1.0
    return 0.5 * float((LAM * e * e).sum())


def model_and_optimizer():
    model = torch.nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.zero_()
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def simulate(size, rule, seed, total=TOTAL):
    """``size`` workers simulated in one process, with an ``elastic.LRScaler`` fed the
    gradient norms a DistributedOptimizer would feed it. ``size`` is an int or a
    function of the step number. Returns the excess loss on the integer grid of
    scale-invariant iterations 0..total (the loss after the step that passed each
    point; inf once it diverged) and the scaler."""
    import elastic
    sizes = size if callable(size) else (lambda step: size)
    step = [0]
    gen = torch.Generator().manual_seed(seed)
    model, opt = model_and_optimizer()
    scaler = elastic.LRScaler(opt, base_size=1, rule=rule, size_fn=lambda: sizes(step[0]))
    scaler.drive(torch.optim.lr_scheduler.StepLR(opt, step_size=DECAY, gamma=0.1))
    curve = [excess_loss(model.weight)]
    while scaler.progress < total and len(curve) <= total:
        workers = sizes(step[0])
        x, y = batches(gen, workers)
        w = model.weight.detach().reshape(-1)
        local = torch.einsum("sbd,sb->sd", x, x @ w - y) / B     # each worker's gradient
        mean = local.mean(dim=0)
        model.weight.grad = mean.reshape(1, D).clone()
        if rule == "adascale":
            scaler.observe(float((local * local).sum()), float(mean @ mean), workers)
        opt.step()
        step[0] += 1
        loss = excess_loss(model.weight)
        if not math.isfinite(loss) or loss > 1e6:
            curve += [math.inf] * (total + 1 - len(curve))
            break
        while len(curve) <= min(total, int(scaler.progress)):
            curve.append(loss)
    scaler.remove()
    return curve, scaler


def mean_curve(curves):
    return [sum(values) / len(values) for values in zip(*curves)]


def first_below(curve, target):
    """The first scale-invariant iteration whose loss is below ``target``, or None."""
    return next((i for i, v in enumerate(curve) if v < target), None)
