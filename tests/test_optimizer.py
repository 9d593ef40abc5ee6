"""Tests for elastic.optimizer: standalone, with a faked runtime, and on real gloo groups."""

import importlib.util
import os
import sys
import textwrap

import pytest
import torch

from elastic.exceptions import WorkersDepartedError
from elastic.training.optimizer import Compression, DistributedOptimizer
from elastic.training.optimizer_layout import FIRST_BUCKET_BYTES, build_buckets
from elastic.worker import collectives

sys.path.insert(0, os.path.dirname(__file__))
from support.harness import check_ok, run_workers  # noqa: E402
from support.optimizer_fakes import FakeComm, FakeWorker, batch_of, tiny_model, train_steps  # noqa: E402

# The worker script: each rank trains every config, then saves its parameters.
# The test process imports the same file to compute single-process references.
WORKER = textwrap.dedent('''
    import os
    import sys

    import torch

    STEPS = 4
    CONFIGS = {
        "sgd": dict(opt="sgd", named=True),
        "sgd_tiny": dict(opt="sgd", cap=1e-5),
        "adam": dict(opt="adam"),
        "fp16": dict(opt="sgd", compression="fp16"),
        "accum": dict(opt="sgd", k=2, cap=1e-4),
        "unused": dict(opt="sgd", cap=1e-4, model="unused"),
        "clip": dict(opt="sgd", clip=0.05),
    }


    class Net(torch.nn.Module):
        """``never`` is never used; ``extra`` only on rank 1; ``frozen`` is frozen."""

        def __init__(self, unused):
            super().__init__()
            self.unused = unused
            if unused:
                self.never = torch.nn.Parameter(torch.ones(3))
            self.fc1 = torch.nn.Linear(8, 16)
            if unused:
                self.extra = torch.nn.Linear(16, 4)
            self.fc2 = torch.nn.Linear(16, 4)
            if unused:
                self.frozen = torch.nn.Linear(4, 4)
                self.frozen.requires_grad_(False)

        def forward(self, x, rank):
            h = torch.tanh(self.fc1(x))
            y = self.fc2(h)
            if self.unused:
                y = self.frozen(y)
                if rank == 1:
                    y = y + self.extra(h)
            return y


    def build(name):
        cfg = dict(CONFIGS[name])
        torch.manual_seed(0)
        model = Net(cfg.get("model") == "unused")
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg["opt"] == "sgd":
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        else:
            opt = torch.optim.Adam(params, lr=0.01)
        return cfg, model, opt


    def loss(model, rank, step, micro):
        g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        return ((model(x, rank) - y) ** 2).mean()


    def train(name, rank):
        from elastic.training.optimizer import Compression, DistributedOptimizer
        cfg, model, opt = build(name)
        k = cfg.get("k", 1)
        dopt = DistributedOptimizer(
            opt, named_parameters=model.named_parameters() if cfg.get("named") else None,
            compression=getattr(Compression, cfg.get("compression", "none")),
            backward_passes_per_step=k, bucket_cap_mb=cfg.get("cap", 25))
        for step in range(STEPS):
            dopt.zero_grad()
            for micro in range(k):
                loss(model, rank, step, micro).backward()
            if "clip" in cfg:
                dopt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
                with dopt.skip_synchronize():
                    dopt.step()
            else:
                dopt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {"params": params, "wire_bytes": dopt.wire_bytes, "buckets": dopt.bucket_count}


    def reference(name, n):
        """One process, n simulated ranks: average their gradients by hand."""
        cfg, model, opt = build(name)
        k = cfg.get("k", 1)
        wire = torch.float16 if cfg.get("compression") == "fp16" else torch.float32
        params = [p for p in model.parameters() if p.requires_grad]
        for step in range(STEPS):
            total = [torch.zeros_like(p, dtype=wire) for p in params]
            for rank in range(n):
                model.zero_grad()
                for micro in range(k):
                    loss(model, rank, step, micro).backward()
                for t, p in zip(total, params):
                    if p.grad is not None:
                        t += p.grad.to(wire)
            for t, p in zip(total, params):
                p.grad = (t / n).to(p.dtype)
            if "clip" in cfg:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            opt.step()
        return {n_: p.detach().clone() for n_, p in model.named_parameters()}


    if __name__ == "__main__":
        import elastic
        elastic.init()
        rank = elastic.rank()
        results = {name: train(name, rank) for name in CONFIGS}
        torch.save(results, os.path.join(os.environ["OUT_DIR"], f"rank{rank}.pt"))
''')

N = 2


def _load_worker_module(path):
    spec = importlib.util.spec_from_file_location("optimizer_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- standalone (size 1) --------------------------------------------------------------------------


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("compression", [Compression.none, Compression.fp16])
def test_standalone_matches_plain_optimizer_bitwise(make_opt, k, compression):
    plain_model, wrapped_model = tiny_model(), tiny_model()
    expected = train_steps(plain_model, make_opt(plain_model.parameters()), k=k)
    dopt = DistributedOptimizer(make_opt(wrapped_model.parameters()),
                                named_parameters=wrapped_model.named_parameters(),
                                compression=compression, backward_passes_per_step=k,
                                bucket_cap_mb=1e-4)
    got = train_steps(wrapped_model, dopt, k=k)
    assert dopt.bucket_count > 1
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_accumulation_sums_k_backward_passes():
    single, accum = tiny_model(), tiny_model()
    train_steps(single, DistributedOptimizer(torch.optim.SGD(single.parameters(), lr=0.1)), steps=1)
    dopt = DistributedOptimizer(torch.optim.SGD(accum.parameters(), lr=0.1),
                                backward_passes_per_step=2)
    train_steps(accum, dopt, steps=1, k=2)
    assert not all(torch.equal(a, b) for a, b in zip(single.parameters(), accum.parameters()))
    # A third pass before step() would silently miss the allreduce: it is an error instead.
    x, y = batch_of(0)
    for _ in range(2):
        ((accum(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step"):
        ((accum(x) - y) ** 2).mean().backward()


def test_fp16_halves_wire_bytes():
    counts = {}
    for name, compression in [("none", Compression.none), ("fp16", Compression.fp16)]:
        model = tiny_model()
        dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    compression=compression)
        train_steps(model, dopt, steps=3)
        counts[name] = dopt.wire_bytes
    n_params = sum(p.numel() for p in tiny_model().parameters())
    assert counts["none"] == 3 * 4 * n_params
    assert counts["fp16"] * 2 == counts["none"]


def test_compressors_round_trip():
    t = torch.randn(5, dtype=torch.float64)
    wire, ctx = Compression.fp16.compress(t)
    assert wire.dtype == torch.float16
    assert Compression.fp16.decompress(wire, ctx).dtype == torch.float64
    ints = torch.arange(4)
    assert Compression.fp16.compress(ints)[0].dtype == torch.int64
    wire, ctx = Compression.none.compress(t)
    assert Compression.none.decompress(wire, ctx) is t


def test_delegates_to_wrapped_optimizer():
    model = tiny_model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    dopt = DistributedOptimizer(inner)
    assert isinstance(dopt, torch.optim.Optimizer)
    assert dopt.param_groups is inner.param_groups and dopt.state is inner.state
    assert dopt.defaults is inner.defaults
    train_steps(model, dopt, steps=2)
    assert all(p.grad is not None for p in model.parameters())
    dopt.zero_grad()  # gradients stay views into the buckets, zeroed in place
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    saved = dopt.state_dict()
    assert saved["state"][0]["step"] == inner.state_dict()["state"][0]["step"]
    fresh_model = tiny_model()
    fresh = DistributedOptimizer(torch.optim.Adam(fresh_model.parameters(), lr=0.01))
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])
    # Unknown attributes come from the wrapped optimizer; lr schedulers accept the wrapper.
    assert dopt.register_step_post_hook is not None
    scheduler = torch.optim.lr_scheduler.StepLR(dopt, step_size=1, gamma=0.5)
    train_steps(model, dopt, steps=1)
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.005)
    extra = torch.nn.Parameter(torch.zeros(2))
    dopt.add_param_group({"params": [extra]})
    (extra.sum() + model(batch_of(0)[0]).sum()).backward()
    dopt.step()
    assert dopt.bucket_count >= 1 and not torch.equal(extra, torch.zeros(2))


def test_named_parameters_are_validated():
    model = tiny_model()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="duplicate"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=[("w", p) for _, p in named])
    with pytest.raises(ValueError, match="not in named_parameters"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=named[:-1])
    with pytest.raises(ValueError, match="pairs"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             named_parameters=[p for _, p in named])
    with pytest.raises(ValueError):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             backward_passes_per_step=0)
    DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)


# -- a faked worker: launch order, overlap, rebuilds ----------------------------------------------


def test_a_bucket_closes_after_the_parameter_that_fills_it_the_first_at_1_mib():
    # A layer's bias and weight gradients come from one backward node: a bucket boundary
    # between them (the bias taken first, in reverse order) would hold the earlier bucket
    # back until that layer's backward. As with DDP, a bucket closes after the parameter
    # that fills it, and the first one at 1 MiB, so the link starts early.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512),
                                torch.nn.Linear(512, 10))
    names = {p: n for n, p in model.named_parameters()}
    params = list(model.parameters())

    def layout(cap):
        buckets = build_buckets(params, None, cap, Compression.none, as_view=True)
        return [[names[p] for p in b.params] for b in buckets]
    assert FIRST_BUCKET_BYTES == 2 ** 20
    # 2 MiB weights: the first bucket closes after 1.weight, past 1 MiB; the rest fits 3 MiB.
    assert layout(3 * 2 ** 20) == [["2.bias", "2.weight", "1.bias", "1.weight"],
                                   ["0.bias", "0.weight"]]
    # The cap closes the later buckets after the parameter that reaches it.
    assert layout(2 * 2 ** 20) == [["2.bias", "2.weight", "1.bias", "1.weight"],
                                   ["0.bias", "0.weight"]]
    # A cap under 1 MiB applies to the first bucket too.
    assert layout(16 * 1024) == [["2.bias", "2.weight"], ["1.bias", "1.weight"],
                                 ["0.bias", "0.weight"]]


def test_buckets_launch_during_backward_in_reverse_order(monkeypatch):
    comm = FakeComm(monkeypatch, FakeWorker())
    model = tiny_model()
    params = list(model.parameters())
    dopt = DistributedOptimizer(torch.optim.SGD(params, lr=0.1), bucket_cap_mb=1e-6)
    x, y = batch_of(0)
    ((model(x) - y) ** 2).mean().backward()
    # Every bucket was launched by the hooks, before step(): communication overlaps backward.
    assert [t.numel() for t in comm.launched] == [p.numel() for p in reversed(params)]
    expected = [2 * p.grad for p in params]
    dopt.synchronize()
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    with dopt.skip_synchronize():
        dopt.step()
    assert len(comm.launched) == len(params)


def test_unused_parameter_holds_back_later_buckets_and_sends_zeros(monkeypatch):
    comm = FakeComm(monkeypatch, FakeWorker())
    model = tiny_model()
    unused = torch.nn.Parameter(torch.ones(4))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    params = [unused, frozen] + list(model.parameters())  # unused goes in the last bucket
    dopt = DistributedOptimizer(torch.optim.SGD(params, lr=0.1), bucket_cap_mb=1e-6)
    x, y = batch_of(0)
    ((model(x) - y) ** 2).mean().backward()
    assert len(comm.launched) == 4  # the model's buckets; the unused one waits for synchronize
    dopt.step()
    assert len(comm.launched) == 5 and torch.equal(comm.launched[-1], torch.zeros(4))
    assert torch.equal(unused.grad, torch.zeros(4)) and frozen.grad is None
    assert torch.equal(unused, torch.ones(4)) and torch.equal(frozen, torch.ones(2))


def test_new_round_and_departed_workers_rebuild_buffers(monkeypatch):
    worker = FakeWorker()
    comm = FakeComm(monkeypatch, worker)
    model = tiny_model()
    dopt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    train_steps(model, dopt, steps=2)
    first = comm.launched[0]
    assert all(t is first for t in comm.launched)  # one preallocated buffer, reused
    worker.round_id = 2
    train_steps(model, dopt, steps=1)
    assert comm.launched[-1] is not first  # new round: new buffer
    second = comm.launched[-1]
    comm.fail = True
    with pytest.raises(WorkersDepartedError):
        train_steps(model, dopt, steps=1)
    comm.fail = False
    train_steps(model, dopt, steps=1)  # same round id, yet the abandoned buffer is not reused
    assert comm.launched[-1] is not second
    # A failure while launching from a hook surfaces from synchronize(), not mid-backward.
    monkeypatch.setattr(collectives, "allreduce_async",
                        lambda t, op: (_ for _ in ()).throw(WorkersDepartedError("gone")))
    dopt.zero_grad()
    x, y = batch_of(0)
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(WorkersDepartedError):
        dopt.step()


# -- real gloo, two processes ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("optimizer_workers")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    check_ok(run_workers(script, N, timeout=240, extra_env={"OUT_DIR": str(tmp)}))
    ranks = [torch.load(tmp / f"rank{r}.pt") for r in range(N)]
    return ranks, _load_worker_module(script)


@pytest.mark.parametrize("name", ["sgd", "sgd_tiny", "adam", "fp16", "accum", "unused", "clip"])
def test_ranks_agree_and_match_manual_average(gloo_run, name):
    ranks, worker = gloo_run
    for other in ranks[1:]:
        for key, value in ranks[0][name]["params"].items():
            assert torch.equal(value, other[name]["params"][key]), key
    expected = worker.reference(name, N)
    tol = dict(rtol=1e-3, atol=1e-4) if name == "fp16" else dict(rtol=1e-6, atol=1e-7)
    for key, value in ranks[0][name]["params"].items():
        torch.testing.assert_close(value, expected[key], **tol, msg=key)


def test_gloo_frozen_untouched_and_fp16_halves_bytes(gloo_run):
    ranks, worker = gloo_run
    _, model, _ = worker.build("unused")
    for key in ("frozen.weight", "frozen.bias", "never"):
        assert torch.equal(ranks[0]["unused"]["params"][key], dict(model.named_parameters())[key])
    assert ranks[0]["fp16"]["wire_bytes"] * 2 == ranks[0]["sgd"]["wire_bytes"] > 0


def test_gloo_many_buckets_equal_one_bucket(gloo_run):
    ranks, _ = gloo_run
    assert ranks[0]["sgd"]["buckets"] == 1 and ranks[0]["sgd_tiny"]["buckets"] == 4
    for key, value in ranks[0]["sgd"]["params"].items():
        assert torch.equal(value, ranks[0]["sgd_tiny"]["params"][key]), key
