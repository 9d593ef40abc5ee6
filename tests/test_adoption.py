"""What a restarted serving driver takes back (issue 27): pure decisions, no processes."""

import json

from elastic.protocol import ENV_CHECKPOINT_DIR, Keys, Member
from elastic.runner.adoption import (
    Adoption,
    Strays,
    free_slots,
    next_worker_after,
    rank_order,
    round_floor,
    window_over,
    with_floor,
)
from elastic.runner.cli import no_checkpoint_warning
from elastic.runner.decisions import Job, Publish, Spawn
from elastic.runner.hosts import HostManager
from elastic.runner.planner import plan_round
from elastic.runner.records import WorkerRecord
from elastic.runner.state_dir import FILE, StateDir, decode, encode, resume


def test_the_next_round_comes_after_every_round_a_worker_knows():
    values = [{"round": 3, "latest": 4}, None, {"round": 2, "latest": True}, "junk",
              {"round": 7.5}, {"beat": 9}]
    assert round_floor(values) == 4
    assert round_floor(values, floor=6) == 6
    assert round_floor([]) == 0


def test_worker_ids_never_collide_with_adopted_ones():
    assert next_worker_after(0, ["3", "1", "x"]) == 4
    assert next_worker_after(9, ["3"]) == 9
    assert free_slots({0, 2}, 3) == [1, 3, 4]


def test_with_floor_counts_the_adopted_as_holders_of_the_floor_round():
    job = with_floor(Job(), 5, {"1", "0"})
    assert job.round_id == 5 and list(job.rounds[5]) == ["0", "1"]
    assert "0" in job.rounds[5] and job.admitted("1")
    running = Job(round_id=2, members=(Member("0", "a", 0, 1, 0, 1, 0, 1),))
    assert with_floor(running, 9, {"0"}) is running     # after its first round: untouched


def _record(worker_id):
    return WorkerRecord(worker_id, f"host-{worker_id}", 0, None, 0.0)


class _Store:
    def __init__(self, values):
        self.values = values

    def get_many(self, keys):
        return {k: self.values.get(k) for k in keys}

    def fetch(self, key):          # the registrations' doorbell: names, one a line
        value = self.values.get(key)
        return value.encode() if isinstance(value, str) else None


def test_adopted_workers_wait_for_the_window_even_when_found_again():
    adoption = Adoption(window_s=3.0)
    adoption.first_at, adoption.waiting = 10.0, {"0", "1"}
    workers = {"0": _record("0"), "1": _record("1"), "7": _record("7")}
    store = _Store({Keys.ready("0"): {"round": 4, "latest": 5}, Keys.heartbeat("1"): {"round": 4}})
    ready, job = adoption.release({"0", "7"}, 11.0, Job(), store, workers)
    assert ready == {"7"} and job.round_id == 0          # a new one is ready at once
    ready, job = adoption.release({"0"}, 12.0, job, store, workers)   # a full look: still held
    assert ready == set()
    assert not window_over(adoption.first_at, 12.9, 3.0)
    ready, job = adoption.release({"1"}, 13.0, job, store, workers)
    assert ready == {"0", "1"} and job.round_id == 5     # the next round is 6: newer for all
    gone = Adoption(window_s=0.0)
    gone.first_at, gone.held = 0.0, {"5"}
    assert gone.release(set(), 1.0, Job(), _Store({}), workers)[0] == set()   # exited meanwhile


def test_state_dir_round_trip_and_a_damaged_file(tmp_path):
    hosts = HostManager((10.0, 10.0))
    hosts.update({"a": 1, "b": 1}, 0.0)
    hosts.blacklist("a", 100.0)
    job = Job(round_id=6, next_worker=9, resets=4)
    data = encode(job, hosts, 104.0)
    assert decode(json.loads(json.dumps(data)))[:3] == (6, 9, 4)
    saved = StateDir(str(tmp_path))
    saved.note(Spawn("8", "a", 0, {}), job, hosts, 104.0)
    assert json.loads((tmp_path / FILE).read_text())["round"] == 6
    assert not list(tmp_path.glob("*.tmp"))                # written by rename
    again, fresh = HostManager((10.0, 10.0)), Adoption()
    restored = resume(saved, Job(), again, fresh, 500.0)
    assert (restored.next_worker, restored.resets, fresh.floor) == (9, 4, 6)
    assert again.failures("a") == 1 and again.is_blacklisted("a", 505.0)
    assert not again.is_blacklisted("a", 506.5)            # the 6 s of cooldown left
    (tmp_path / FILE).write_text("{not json")
    assert StateDir(str(tmp_path)).read_back() == (0, 0, 0, {})
    assert decode({"round": -3, "next_worker": "x", "blacklist": []}) == (0, 0, 0, {})
    StateDir(None).note(Publish(1, (), "start"), job, hosts, 0.0)   # no dir: nothing


def test_a_blacklisted_for_good_host_stays_so():
    hosts = HostManager(None)
    hosts.blacklist("a", 1.0)
    again = HostManager(None)
    again.restore(hosts.export(2.0), 50.0)
    assert again.is_blacklisted("a", 1e12) and again.failures("a") == 1


def test_a_job_without_checkpoint_dir_is_warned_once():
    line = no_checkpoint_warning({}, {}, serving=False)
    assert "no --checkpoint-dir" in line and "outside joining mode" in line
    assert "outside joining mode" not in no_checkpoint_warning({}, {}, serving=True)
    assert no_checkpoint_warning({ENV_CHECKPOINT_DIR: "/c"}, {}, serving=False) is None
    assert no_checkpoint_warning({}, {ENV_CHECKPOINT_DIR: "/c"}, serving=True) is None


def test_the_adopted_round_re_forms_from_its_workers():
    """decide() publishes the next round with the adopted workers: none of them counts as
    left out of a round the new driver never had (its predecessor's)."""
    from elastic.runner.decisions import Facts, Limits, WorkerView
    from elastic.runner.policy import decide
    from elastic.runner.stalls import Liveness
    hosts = HostManager(None)
    hosts.update({"node-a": 1, "node-b": 1}, 0.0)

    def view(wid, host):
        liveness = Liveness(beat_at=10.0, progress_at=10.0)
        liveness.update({"beat": 5, "holds": 7, "commits": 3, "waits": 4}, 11.0)
        return WorkerView(wid, host, 0, 10.0, ready=True, beats=5, heartbeat_at=11.0,
                          liveness=liveness)
    facts = Facts(job=with_floor(Job(), 4, {"0", "1"}), limits=Limits(np=2, min_np=2),
                  hosts=hosts, workers={"0": view("0", "node-a"), "1": view("1", "node-b")},
                  liveness_checked=True)
    published = [a for a in decide(facts, 12.0) if isinstance(a, Publish)]
    assert len(published) == 1 and published[0].round_id == 5
    assert {m.worker_id for m in published[0].members} == {"0", "1"}


def test_an_announced_worker_keeps_the_window_open_while_its_heartbeat_moves():
    strays = Strays(silent_s=5.0)
    strays.announced("2", {"adopt": True, "round": 4}, 10.0)
    strays.announced("9", {"round": 4}, 10.0)      # a first registration, not an announcement
    strays.announced("8", None, 10.0)              # absent, or forged (read as None)
    assert strays.awaited(set(), 10.0) == {"2"}
    assert not window_over(0.0, 10.0, 3.0, {"2"}, wait_s=20.0)
    assert window_over(0.0, 20.0, 3.0, {"2"}, wait_s=20.0)     # --worker-timeout: no longer
    assert window_over(0.0, 3.0, 3.0, set(), wait_s=20.0)
    assert not window_over(0.0, 2.9, 3.0, set(), wait_s=20.0)
    strays.beat("2", {"beat": 7}, 12.0)
    strays.beat("2", {"beat": 7}, 16.0)                         # stood still since 12.0
    assert strays.awaited(set(), 16.9) == {"2"}
    assert strays.awaited(set(), 17.1) == set()                  # died with its agent
    strays.announced("3", {"adopt": True}, 20.0)
    assert strays.awaited({"3"}, 20.0) == set()                  # its agent is back


def test_adoption_waits_for_the_agent_of_a_worker_that_announced_itself():
    """Worker 1 announced itself (its heartbeat reaches the store) while its agent is cut
    off: the adopted round waits for it past the window, then forms with it."""
    adoption = Adoption(window_s=3.0, wait_s=20.0)
    adoption.first_at, adoption.waiting = 10.0, {"0"}
    values = {Keys.REGISTERED: "0\n1\n1\nbogus\n",
              Keys.ready("0"): {"round": 4, "adopt": True},
              Keys.ready("1"): {"round": 4, "latest": 5, "adopt": True},
              Keys.heartbeat("1"): {"beat": 1}}
    store = _Store(values)
    ready, job = adoption.release({"0"}, 11.0, Job(), store, {"0": _record("0")})
    assert ready == set()
    ready, job = adoption.release(set(), 14.0, job, store, {"0": _record("0")})
    assert ready == set() and job.round_id == 0          # the window passed: waits for 1
    values[Keys.heartbeat("1")] = {"beat": 2}
    workers = {"0": _record("0"), "1": _record("1")}             # its agent came back with it
    adoption.waiting.add("1")
    ready, job = adoption.release({"1"}, 15.0, job, store, workers)
    assert ready == {"0", "1"} and job.round_id == 5
    late = Adoption(window_s=3.0, wait_s=20.0)
    late.first_at, late.waiting = 10.0, {"0"}
    late.strays.silent_s = 100.0            # its heartbeat moves on, its agent never comes
    late.release({"0"}, 11.0, Job(), _Store(dict(values)), {"0": _record("0")})
    assert late.release(set(), 29.0, Job(), _Store(dict(values)), {"0": _record("0")})[0] == set()
    assert late.release(set(), 30.0, Job(), _Store(dict(values)), {"0": _record("0")})[0] == {"0"}


def test_adopted_workers_keep_their_previous_rank_order():
    """Rank 0 stays on the worker that had it (its logging, its checkpoint writes): hosts
    in the order of their workers' previous ranks, and a host's slots in that order too,
    whatever order the agents came back in."""
    records = [WorkerRecord("4", "node-b", 0, None, 0.0), WorkerRecord("2", "node-a", 0, None, 0.0),
               WorkerRecord("3", "node-a", 1, None, 0.0), WorkerRecord("7", "node-c", 0, None, 0.0)]
    ranks = {"4": 0, "2": 2, "3": 1}                      # node-c's worker did not say
    assert rank_order(records, ranks) == ("node-b", "node-a", "node-c")
    assert {r.worker_id: r.slot for r in records} == {"4": 0, "3": 0, "2": 1, "7": 0}
    job = with_floor(Job(), 5, {"4", "2", "3", "7"}, ("node-b", "node-a", "node-c"))
    planned = plan_round(records, list(job.host_order))
    assert [m.worker_id for m in planned] == ["4", "3", "2", "7"]

