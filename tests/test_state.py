"""Tests for elastic.state: commit/restore standalone, and sync on real gloo groups."""

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from elastic.state.states import ObjectState, State, TorchState
from elastic.training.sampler import ElasticSampler
from elastic.worker import runtime

sys.path.insert(0, os.path.dirname(__file__))
from support.harness import check_ok, run_workers  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workloads" / "state_sync_worker.py"




# -- helpers ----------------------------------------------------------------------------------------
def _bytes(t):
    return t.detach().contiguous().cpu().numpy().tobytes()


def assert_tree_bitwise(a, b, path="root"):
    if torch.is_tensor(a):
        assert torch.is_tensor(b), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert _bytes(a) == _bytes(b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for k in a:
            assert_tree_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_bitwise(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)


def _build(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = ElasticSampler(list(range(40)), shuffle=True, seed=1)
    state = TorchState(model, opt, sampler=sampler, scheduler=sched, epoch=0, batch=0,
                       history=[1.0])
    return state


def _train(state, steps, start=0):
    for i in range(start, start + steps):
        x, y = _batch(i)
        state.optimizer.zero_grad()
        loss = ((state.model(x) - y) ** 2).mean()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.sampler.record_batch(i, 4)
        state.batch += 1
        state.history.append(loss.item())


def _capture(state):
    """A deep, independent copy of everything the state covers."""
    return {
        "model": copy.deepcopy(state.model.state_dict()),
        "optimizer": copy.deepcopy(state.optimizer.state_dict()),
        "scheduler": copy.deepcopy(state.scheduler.state_dict()),
        "sampler": state.sampler.state_dict(),
        "epoch": state.epoch, "batch": state.batch, "history": list(state.history),
        "lr": [g["lr"] for g in state.optimizer.param_groups],
    }


def _storage_ptrs(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _live_tensors(state):
    out = [p for p in state.model.parameters()]
    for per_param in state.optimizer.state.values():
        out.extend(v for v in per_param.values() if torch.is_tensor(v))
    return out


# -- standalone -------------------------------------------------------------------------------------
def test_standalone_has_no_worker():
    assert runtime.worker() is None


def test_restore_returns_to_commit_bitwise():
    state = _build()
    _train(state, 3)
    assert state.optimizer.state  # Adam state exists: exp_avg, exp_avg_sq, step
    state.commit()
    assert state.commit_version == 1
    committed = _capture(state)
    assert "exp_avg" in committed["optimizer"]["state"][0]

    _train(state, 3, start=10)
    state.epoch = 5
    state.history.append(-1.0)
    for g in state.optimizer.param_groups:
        g["lr"] = 123.0
    changed = _capture(state)
    with pytest.raises(AssertionError):
        assert_tree_bitwise(committed["model"], changed["model"])
    with pytest.raises(AssertionError):
        assert_tree_bitwise(committed["optimizer"], changed["optimizer"])
    assert changed["sampler"] != committed["sampler"]

    state.restore()
    assert_tree_bitwise(committed, _capture(state))
    assert state.commit_version == 1


def test_restore_does_not_alias_snapshot():
    state = _build()
    _train(state, 2)
    state.commit()
    committed = _capture(state)
    snapshot_ptrs = _storage_ptrs(state.snapshot.buffers)

    for round_ in range(3):
        state.restore()
        assert not (_storage_ptrs(_live_tensors(state)) & snapshot_ptrs)
        assert_tree_bitwise(committed, _capture(state))
        # Training after a restore must not write through into the snapshot.
        _train(state, 2, start=20 + 2 * round_)
        state.history.append(0.0)
    state.restore()
    assert_tree_bitwise(committed, _capture(state))


def test_commit_after_restore():
    state = _build()
    _train(state, 2)
    state.commit()
    _train(state, 2, start=5)
    state.restore()
    _train(state, 3, start=50)
    state.commit()
    assert state.commit_version == 2
    second = _capture(state)
    _train(state, 1, start=80)
    state.restore()
    assert_tree_bitwise(second, _capture(state))


def test_restore_before_any_commit_is_a_noop():
    state = _build()
    before = _capture(state)
    state.restore()
    assert_tree_bitwise(before, _capture(state))
    assert state.commit_version == -1


def test_object_state():
    state = ObjectState(epoch=1, best=0.5, seen=[1, 2], weights=torch.arange(3.0))
    state.commit()
    state.epoch = 9
    state.best = 0.1
    state.seen.append(3)
    state.weights.add_(10)
    state.restore()
    assert (state.epoch, state.best, state.seen) == (1, 0.5, [1, 2])
    assert torch.equal(state.weights, torch.arange(3.0))
    # Restored values are copies: mutating them leaves the commit intact.
    state.seen.append(4)
    state.weights.add_(1)
    state.restore()
    assert state.seen == [1, 2]
    assert torch.equal(state.weights, torch.arange(3.0))


def test_reset_callbacks_run_in_order_after_reset():
    calls = []

    class Tracked(ObjectState):
        def reset(self):
            calls.append("reset")

    state = Tracked(x=1)
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.register_reset_callbacks([lambda: calls.append("c")])
    state.on_reset()
    assert calls == ["reset", "a", "b", "c"]


def test_torch_state_reset_resplits_sampler():
    state = _build()
    state.sampler.record_batch(0, 4)
    before = state.sampler.processed_num
    state.on_reset()
    assert state.sampler.processed == before and state.sampler.processed_num == before


def test_check_host_updates_and_sync_standalone():
    state = _build()
    assert state.check_host_updates() is None
    state.commit()
    state.commit()
    assert state.commit_version == 2
    committed = _capture(state)
    state.sync()
    assert state.commit_version == 2
    assert state.sync_stats["syncs"] == 1
    assert state.sync_stats["bytes_received"] == state.sync_stats["bytes_sent"] == 0
    assert_tree_bitwise(committed, _capture(state))
    fresh = _build()
    fresh.sync()
    assert fresh.commit_version == 0


def test_base_state_hooks_are_abstract():
    with pytest.raises(NotImplementedError):
        State().commit()


# -- two processes, real gloo -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state_workers")
    check_ok(run_workers(WORKER, 2, timeout=240, extra_env={"STATE_OUT": str(tmp)}))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_initial_sync_takes_rank0_parameters(gloo_run):
    r0, r1 = gloo_run
    assert (r0["rank"], r1["rank"], r0["size"]) == (0, 1, 2)
    assert r0["initial_before"]["params"] != r1["initial_before"]["params"]
    assert r0["initial_after"]["params"] == r0["initial_before"]["params"]
    assert r1["initial_after"]["params"] == r0["initial_before"]["params"]
    assert r0["initial_after"]["stats"]["root"] == r1["initial_after"]["stats"]["root"] == 0
    assert r1["initial_after"]["stats"]["bytes_received"] > 0
    assert r0["initial_after"]["stats"]["bytes_sent"] == r1["initial_after"]["stats"]["bytes_received"]
    assert r0["initial_after"]["version"] == r1["initial_after"]["version"] == 0


@pytest.mark.slow
def test_newcomer_gets_params_and_optimizer_state_without_nudging_root(gloo_run):
    r0, r1 = gloo_run
    for key in ("params", "opt", "sampler", "batch"):
        assert r0["trained"][key] == r1["trained"][key], key
    assert r0["trained"]["version"] == r1["trained"]["version"] == 3
    # Rank 1 really started over.
    assert r1["newcomer_before"]["version"] == -1
    assert r1["newcomer_before"]["opt"]["state"] == {}
    assert r1["newcomer_before"]["params"] != r0["newcomer_before"]["params"]
    # Rank 0 is untouched by the sync (no dummy optimizer step, no weight decay nudge).
    for key in ("params", "opt", "sampler", "epoch", "batch"):
        assert r0["newcomer_after"][key] == r0["newcomer_before"][key], key
    # Rank 1 ends with rank 0's parameters, optimizer state, sampler and attributes.
    for key in ("params", "opt", "sampler", "epoch", "batch", "version"):
        assert r1["newcomer_after"][key] == r0["newcomer_after"][key], key
    assert set(r1["newcomer_after"]["opt"]["state"]["0"]) >= {"exp_avg", "exp_avg_sq", "step"}
    assert r1["newcomer_after"]["stats"]["root"] == r0["newcomer_after"]["stats"]["root"] == 0
    assert r1["newcomer_delta"]["bytes_received"] > 0
    assert r0["newcomer_delta"]["bytes_sent"] == r1["newcomer_delta"]["bytes_received"]
    assert r0["newcomer_delta"]["bytes_received"] == r1["newcomer_delta"]["bytes_sent"] == 0
    # The next joint step keeps the ranks bitwise equal.
    for key in ("params", "opt", "sampler", "batch", "version"):
        assert r1["newcomer_next_step"][key] == r0["newcomer_next_step"][key], key


@pytest.mark.slow
def test_rollback_right_after_a_newcomer_sync_restores_the_synced_commit(gloo_run):
    r0, r1 = gloo_run
    # The newcomer received into the buffers it reserved (and touched) at construction.
    assert r1["newcomer_before"]["stats"]["received_into"] is None
    assert r1["newcomer_after"]["stats"]["received_into"] == "reserve"
    # Its optimizer state was copied into the touched arena (one storage), not fresh memory,
    # and the rollback below still restores the commit: the arena is not the snapshot.
    assert r1["newcomer_after"]["stats"]["copied_into"] == "arena"
    assert r1["newcomer_after"]["opt_storages"] == 1 < r0["newcomer_after"]["opt_storages"]
    for r in gloo_run:
        for key in ("params", "opt", "sampler", "epoch", "batch"):
            assert r["rollback_changed"][key] != r0["trained"][key], key
            assert r["rollback_after_sync"][key] == r0["trained"][key], key
        assert r["rollback_after_sync"]["version"] == r0["trained"]["version"]


@pytest.mark.slow
def test_restore_after_sync_returns_to_last_commit(gloo_run):
    for r in gloo_run:
        assert r["restore_after_sync"]["restored"] == r["restore_after_sync"]["committed"]


@pytest.mark.slow
def test_sync_at_same_commit_moves_nothing(gloo_run):
    for r in gloo_run:
        assert r["noop"]["delta"] == {"bytes_received": 0, "bytes_sent": 0}
        for key in ("params", "opt", "sampler", "batch", "version"):
            assert r["noop"]["after"][key] == r["noop"]["before"][key], key
    assert gloo_run[0]["noop"]["after"]["params"] == gloo_run[1]["noop"]["after"]["params"]


@pytest.mark.slow
def test_newest_commit_wins_even_off_rank0(gloo_run):
    r0, r1 = gloo_run
    assert r1["newest_before"]["version"] == r0["newest_before"]["version"] + 1
    assert r1["newest_before"]["params"] != r0["newest_before"]["params"]
    for r in gloo_run:
        assert r["newest_after"]["stats"]["root"] == 1
    # Rank 1 keeps its values; rank 0 receives them.
    for key in ("params", "opt", "sampler", "epoch", "batch", "version"):
        assert r1["newest_after"][key] == r1["newest_before"][key], key
        assert r0["newest_after"][key] == r1["newest_before"][key], key
    assert r0["newest_after"]["epoch"] == 7 and r0["newest_after"]["batch"] == 1234
    assert r0["newest_delta"]["bytes_received"] > 0
    assert r1["newest_delta"]["bytes_sent"] == r0["newest_delta"]["bytes_received"]
    assert r0["newest_delta"]["bytes_sent"] == r1["newest_delta"]["bytes_received"] == 0


CHAIN_WORKER = Path(__file__).resolve().parent / "workloads" / "state_chain_worker.py"


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state_chain")
    check_ok(run_workers(CHAIN_WORKER, 4, timeout=240, extra_env={"STATE_OUT": str(tmp)}))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


def _same(runs, phase, keys=("params", "opt", "sampler", "epoch", "batch", "version")):
    for key in keys:
        assert len({json.dumps(r[phase][key], sort_keys=True) for r in runs}) == 1, (phase, key)


@pytest.mark.slow
def test_one_chain_brings_every_newcomer_to_rank0_state(chain_run):
    _same(chain_run, "initial")
    d = [r["initial_delta"] for r in chain_run]
    total = d[1]["bytes_received"]
    assert total > 0 and d[2]["bytes_received"] == d[3]["bytes_received"] == total
    # Rank 0 sends the state once (not once per receiver); 1 and 2 forward it.
    assert d[0]["bytes_sent"] == d[1]["bytes_sent"] == d[2]["bytes_sent"] == total
    assert d[3]["bytes_sent"] == 0 and d[0]["bytes_received"] == 0


@pytest.mark.slow
def test_holders_stripe_and_newcomers_end_bitwise_equal(chain_run):
    _same(chain_run, "striped")
    _same(chain_run, "striped_next")
    for r in chain_run:
        assert r["striped"]["params"] == chain_run[0]["trained"]["params"]
    d = [r["striped_delta"] for r in chain_run]
    total = d[2]["bytes_received"]
    assert total > 0 and d[3]["bytes_received"] == total
    assert d[0]["bytes_sent"] > 0 and d[1]["bytes_sent"] > 0          # both holders send
    assert d[0]["bytes_sent"] + d[1]["bytes_sent"] == total            # disjoint shares
    assert d[2]["bytes_sent"] == total and d[3]["bytes_sent"] == 0     # 2 forwards to 3
    assert d[0]["bytes_received"] == d[1]["bytes_received"] == 0


@pytest.mark.slow
def test_a_change_after_the_commit_is_sent_live(chain_run):
    r0, r1, r2, r3 = chain_run
    assert r0["changed"]["params"] != r0["trained"]["params"]          # the holders' change
    for r in (r2, r3):
        assert r["changed"]["params"] == r0["changed"]["params"]       # reached the newcomers
    d = [r["changed_delta"] for r in chain_run]
    assert d[0]["bytes_sent"] == d[2]["bytes_received"] > 0            # the root alone sends
    assert d[1]["bytes_sent"] == 0
