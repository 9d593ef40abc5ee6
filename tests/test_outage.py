"""What a restarted serving driver decides about the time it was away (runner/outage.py),
from what --state-dir kept and what the agents that came back report. Pure: no processes
(tests/test_driver_restart.py runs the same cases with real ones)."""

import json

from elastic.messages import Member
from elastic.runner.decisions import Finish, Job, NoteCommit, Publish, RecordExit
from elastic.runner.hosts import HostManager
from elastic.runner.outage import (
    CHECKPOINT,
    FINISHED,
    GO,
    LOST,
    WAIT,
    Back,
    Kept,
    blamed,
    decide_outage,
)
from elastic.runner.state_dir import FILE, StateDir, decode_kept, encode

PAIR = {"0": "node-a", "1": "node-b"}


def _kept(**fields):
    return Kept(**{"round": 4, "members": PAIR, "commit": 17, **fields})


def test_every_member_exited_0_while_the_driver_was_away_is_a_finished_job():
    back = Back(frozenset({"node-a", "node-b"}), codes={"0": 0, "1": 0})
    verdict = decide_outage(_kept(), back, 1.0, 30.0)
    assert verdict.kind == FINISHED and "round 4 exited 0" in verdict.line
    assert "last commit known was 17" in verdict.line
    # One exit the previous driver saw (the final round's) and one an agent reports.
    back = Back(frozenset({"node-a", "node-b"}), codes={"1": 0})
    assert decide_outage(_kept(final_codes={"0": 0}), back, 1.0, 30.0).kind == FINISHED
    assert decide_outage(Kept(finished=True, commit=9), Back(), 0.0, 30.0).kind == FINISHED


def test_it_waits_for_the_agents_of_the_newest_round_before_deciding():
    back = Back(frozenset({"node-a"}), codes={"0": 0})
    assert decide_outage(_kept(), back, 1.0, 30.0).kind == WAIT
    # The wait is over: node-b's worker's fate is unknown, so nothing says it finished.
    assert decide_outage(_kept(), back, 30.0, 30.0).kind == LOST
    # A live worker holds the state: adoption takes over at once.
    live = Back(frozenset({"node-a"}), live=frozenset({"1"}), codes={"0": 3})
    assert decide_outage(_kept(), live, 1.0, 30.0).kind == GO


def test_committed_work_with_no_survivor_follows_the_holders_rule():
    crashed = Back(frozenset({"node-a", "node-b"}), codes={"0": 0, "1": 1})
    lost = decide_outage(_kept(), crashed, 1.0, 30.0)
    assert lost.kind == LOST
    assert lost.line == "no surviving worker holds the training state; the last commit was 17"
    resumed = decide_outage(_kept(durable=15), crashed, 1.0, 30.0)
    assert resumed.kind == CHECKPOINT and "commit 15 or newer" in resumed.line
    # Nothing committed yet, or nothing kept (no --state-dir, a fresh job): start as usual.
    assert decide_outage(_kept(commit=-1), crashed, 1.0, 30.0).kind == GO
    assert decide_outage(Kept(), crashed, 0.0, 30.0).kind == GO


def test_only_unread_failed_exits_are_blamed():
    codes = {"0": 0, "1": -9, "2": 1, "3": 1}
    hosts = dict.fromkeys(codes, "node-c")
    # "3" failed before the previous driver read its exit: it blamed it already.
    assert blamed(codes, {"0", "1", "2"}, hosts) == [("1", "node-c", -9), ("2", "node-c", 1)]


def test_state_dir_keeps_the_progress_a_restarted_driver_needs(tmp_path):
    hosts = HostManager(None)
    members = (Member("0", "node-a", 0, 2, 0, 1, 0, 2), Member("1", "node-b", 1, 2, 0, 1, 1, 2))
    job = Job(round_id=4, members=members, commit=17, durable=15, next_worker=2)
    saved = StateDir(str(tmp_path))
    saved.note(NoteCommit(17, 15), job, hosts, 1.0)
    kept = StateDir(str(tmp_path)).kept
    assert kept == Kept(4, PAIR, 17, 15, {}, False)
    # A driver that has not published yet keeps its predecessor's round and commit.
    again = StateDir(str(tmp_path))
    again.note(Publish(5, (), "start"), Job(round_id=5), hosts, 2.0)
    assert StateDir(str(tmp_path)).kept.members == PAIR
    assert StateDir(str(tmp_path)).kept.commit == 17
    done = Job(round_id=4, members=members, final_round=4, final_codes={"0": 0, "1": 0})
    again.note(RecordExit("1", 0, True), done, hosts, 3.0)
    assert StateDir(str(tmp_path)).kept.final_codes == {"0": 0, "1": 0}
    again.note(Finish(4, 2), done, hosts, 4.0)
    assert StateDir(str(tmp_path)).kept.finished
    assert json.loads((tmp_path / FILE).read_text())["finished"] is True
    assert decode_kept({"round": "x", "members": [], "commit": True}) == Kept()
    assert decode_kept(encode(job, hosts, 0.0)).members == PAIR
