"""State and Checkpointer built and driven against a fake round (a RoundView), with no
worker, no store and no process group; the worker side's typed commit check; and
runtime.worker() as a getter that never connects."""

import pytest
import torch

import elastic
from elastic import protocol
from elastic.exceptions import HostsUpdatedInterrupt
from elastic.worker import round_view, runtime
from elastic.worker.commits import CommitCheck
from elastic.worker.liveness import Progress
from elastic.worker.membership import Membership


class FakeRound:
    """A RoundView of one rank (``rank`` of ``size``) that records what the state asks."""

    def __init__(self, rank=0, size=1, raises=None):
        self.membership = Membership(rank=rank, size=size)
        self.progress = Progress()
        self.cpu_group = None
        self.raises = raises
        self.calls = []

    def allgather(self, tensor):
        self.calls.append("allgather")
        return tensor.clone()          # this rank's row: the others agree with it

    def run_blocking(self, fn, what):
        raise AssertionError(f"nothing moves when every rank holds the commit ({what})")

    def check_commit(self, version):
        self.calls.append(("check", version))
        if self.raises is not None:
            raise self.raises
        return CommitCheck()

    def committed(self, state):
        self.calls.append(("committed", state.commit_version))

    def holds(self, version):
        self.calls.append(("holds", version))

    def read_newcomer_spec(self, name):
        return None


def test_a_commit_tells_the_round_then_the_listeners_then_asks_the_rounds_check():
    rnd = FakeRound()
    state = elastic.ObjectState(step=0)
    state.use_round(rnd)
    state.add_commit_listener(lambda version, snap: rnd.calls.append(
        ("listener", version, snap.materialize()["objects"]["step"])))
    state.sync()
    assert rnd.calls == ["allgather", ("holds", 0)]
    state.step = 1
    state.commit()
    assert rnd.calls[2:] == [("committed", 1), ("listener", 1, 1), ("check", 1)]
    assert state.commit_version == 1


def test_when_the_rounds_check_re_forms_the_commit_stands():
    rnd = FakeRound(raises=HostsUpdatedInterrupt())
    state = elastic.ObjectState(step=0)
    state.use_round(rnd)
    state.sync()
    state.step = 7
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    state.step = 8            # training went on past the commit; a restore goes back to it
    state.restore()
    assert state.step == 7 and state.commit_version == 1


def test_a_state_without_a_round_is_a_world_of_one():
    state = elastic.ObjectState(step=0)
    state.use_round(None)
    state.sync()
    state.step = 3
    state.commit()
    assert state.commit_version == 1 and runtime.worker() is None


def test_the_newcomer_spec_describes_the_snapshots_flats():
    state = elastic.TorchState(torch.nn.Linear(3, 2), elastic_checkpoint=False, n=0)
    state.use_round(None)
    state.sync()
    spec = state.newcomer_spec()
    assert spec["flats"] == [list(x) for x in state.snapshot.specs()]
    assert sum(n for _dtype, n in spec["flats"]) == 3 * 2 + 2


class FakeWorker:
    """What WorkerRound reads of a Worker: membership, progress, control, heartbeat."""

    def __init__(self, rank):
        self.membership = Membership(rank=rank, size=2)
        self.progress = Progress()
        self.puts = []
        self.control = self
        self.heartbeat = self
        self.wakes = 0

    def put(self, key, value):
        self.puts.append((key, value))

    def wake(self):
        self.wakes += 1


def test_rank_0s_round_publishes_the_newcomer_spec_once_per_layout():
    state = elastic.TorchState(torch.nn.Linear(3, 2), elastic_checkpoint=False)
    state.use_round(None)
    state.sync()
    lead, other = FakeWorker(0), FakeWorker(1)
    for w in (lead, other):
        view = round_view.WorkerRound(w)
        view.committed(state)
        view.committed(state)       # same layout: no second put
        view.holds(5)
        view.holds(5)               # already known: no second wake
        assert w.progress.commits == 2 and w.progress.holds == 5 and w.wakes == 1
    key = protocol.Keys.state_spec("TorchState")
    assert lead.puts == [(key, state.newcomer_spec())] and other.puts == []


def _torch_state(ck):
    model = torch.nn.Linear(4, 4)
    return elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              elastic_checkpoint=ck, step=0)


def test_the_checkpointer_writes_only_for_rank_0_of_its_round_and_tells_it(tmp_path):
    follower = elastic.Checkpointer(tmp_path / "a", every_commits=1)
    state = _torch_state(follower)
    rnd = FakeRound(rank=1, size=2)
    state.use_round(rnd)
    state.sync()
    state.commit()
    assert not follower.is_writer and not (tmp_path / "a").exists()

    lead = elastic.Checkpointer(tmp_path / "b", every_commits=1)
    state = _torch_state(lead)
    rnd = FakeRound(rank=0, size=2)
    state.use_round(rnd)
    state.sync()
    state.step = 1
    state.commit()
    assert lead.wait(60) and lead.is_writer
    assert [v for v, _ in elastic.checkpoint.list_checkpoints(tmp_path / "b")] == [1]
    assert rnd.progress.durable == 1          # the heartbeat tells the driver
    lead.close(final=False)


def test_the_commit_check_is_typed_and_its_max_is_what_every_rank_learns():
    rank0 = CommitCheck(pending_round=5, stopping=False)
    rank1 = CommitCheck(leaving=True)
    agreed = CommitCheck.from_tensor(torch.maximum(rank0.to_tensor(), rank1.to_tensor()))
    assert agreed == CommitCheck(pending_round=5, leaving=True, stopping=False)
    assert agreed.reforms and not CommitCheck().reforms
    assert CommitCheck(stopping=True).to_tensor().tolist() == [0, 0, 1]


def test_the_worker_getter_never_connects(monkeypatch):
    monkeypatch.setenv(protocol.ENV_ADDR, "127.0.0.1")
    monkeypatch.setenv(protocol.ENV_PORT, "1")           # nothing listens there
    assert runtime.worker() is None and round_view.current() is None
    assert not runtime.is_initialized()
