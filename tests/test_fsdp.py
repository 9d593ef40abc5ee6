"""FSDP2 state held in shards (elastic.ShardedState), resharded live, with one
redundancy copy per shard: a job whose world goes 4 -> 3 (SIGKILL mid-backward)
-> 5 (two hosts added) -> 4 (one removed) against a fixed 4-worker run of the same
script (tests/workloads/fsdp_job.py), plus the shard plan's pure logic.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.jobs import REPO, Job, sizes_in_order

from elastic.state import shard_files, shard_plan
from elastic.state.shard_plan import Piece, ShardsLost

FSDP_JOB = REPO / "tests" / "workloads" / "fsdp_job.py"
STEPS = 8
SAMPLES, GLOBAL_BATCH = 120, 60


# -- the plan, without processes ---------------------------------------------------------
def test_rows_follow_torch_chunk():
    for total in (0, 1, 3, 7, 32):
        for n in (1, 3, 4, 5):
            want = [c.shape[0] for c in torch.arange(total).chunk(n)] if total else []
            got = [b - a for a, b in (shard_plan.rows(total, n, i) for i in range(n))]
            assert [g for g in got if g] == [w for w in want if w]
            assert sum(got) == total


def test_plan_moves_only_rows_whose_owner_changes():
    meta = [("w", (12, 2), "torch.float32")]
    own = {i: [i] for i in range(4)}                 # 4 -> 4: nothing travels
    assert all(p.src == p.dst for p in shard_plan.plan(meta, 4, own, 4))
    # 4 -> 3: new rank j holds old shard j; rows 0..3 stay on rank 0, the rest move.
    pieces = shard_plan.plan(meta, 4, {0: [0], 1: [1], 2: [2], 3: [0]}, 3)
    assert Piece(0, 0, "w", 0, 0, 3) in pieces and Piece(1, 0, "w", 1, 3, 4) in pieces
    moved = sum(p.stop - p.start for p in pieces if p.src != p.dst)
    assert moved == 12 - 3 - 2 - 1                  # every row kept where it can be
    for dst in range(3):                             # each new rank gets exactly its rows
        start, stop = shard_plan.rows(12, 3, dst)
        got = sorted((p.start, p.stop) for p in pieces if p.dst == dst)
        assert got[0][0] == start and got[-1][1] == stop
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_copies_form_a_ring_and_choose_version_needs_every_shard():
    assert shard_plan.copies_kept(0, 4, 1) == [3] and shard_plan.copy_targets(3, 4, 1) == [0]
    assert shard_plan.copies_kept(1, 2, 3) == [0]       # never more copies than peers
    # Rank 2 of 4 lost: ranks 0, 1, 3 hold {0,3}, {1,0}, {3,2} of commit 5 -> whole.
    held = [[(5, 4, [0, 3])], [(5, 4, [0, 1])], [(5, 4, [2, 3])], []]
    assert shard_plan.choose_version(held) == (5, 4)
    # A commit that did not close everywhere: 6 is whole only with rank 1's shard.
    assert shard_plan.choose_version([[(5, 4, [0, 3]), (6, 4, [0, 3])], [(5, 4, [1, 2])]]) \
        == (5, 4)
    assert shard_plan.choose_version([[], []]) is None
    # Ranks 1 and 2 of 3 leave (copies: 0 holds {0, 2}, 1 {1, 0}, 2 {2, 1}): shard 1
    # is held by leavers only and goes from rank 1 to the one stayer; nothing else moves.
    leaving = [(False, [0, 2]), (True, [0, 1]), (True, [1, 2])]
    assert shard_plan.hand_off(leaving) == [(1, 1, 0)]
    assert shard_plan.hand_off([(False, [0]), (False, [1])]) == []
    assert shard_plan.hand_off([(True, [0]), (True, [1])]) == []
    with pytest.raises(ShardsLost, match=r"shard\(s\) \[1, 2\]"):
        shard_plan.choose_version([[(5, 4, [0, 3])], [(5, 4, [3])]])


# -- real jobs ------------------------------------------------------------------------
def run_fixed(tmp_path):
    job = Job(tmp_path, ["-np", "4", "-H", "localhost:4"], env={"FSDP_STEPS": str(STEPS)},
              script=FSDP_JOB)
    assert job.run() == 0, job.output()[-4000:]
    return job


def run_changing(tmp_path):
    env = {"FSDP_STEPS": str(STEPS), "FSDP_KILL": "3:3", "FSDP_HOLD": "5:5,6:4"}
    job = Job(tmp_path, ["-np", "4", "--min-np", "3", "--max-np", "5"],
              hosts=["localhost:3", "127.0.0.1:1"], env=env, script=FSDP_JOB).start()
    job.wait_step(5, size=3)                                  # rank 3 was killed at step 3
    job.set_hosts(["localhost:3", "127.0.0.2:2"])              # scale up to 5 at step 5
    job.wait_step(6, size=5)
    job.set_hosts(["localhost:3", "127.0.0.2:1"])              # graceful removal at step 6
    assert job.finish() == 0, job.output()[-4000:]
    return job


@pytest.fixture(scope="module")
def fsdp_jobs(tmp_path_factory):
    return (run_fixed(tmp_path_factory.mktemp("fsdp_fixed")),
            run_changing(tmp_path_factory.mktemp("fsdp_changing")))


def finals(job):
    out = [json.loads(p.read_text()) for p in sorted(job.out.glob("final.*.json"))]
    assert len(out) == out[0]["size"], out
    for f in out:
        assert f["agree"], f["worker"]          # every shard equals its rows of the full state
    for key in ("params", "moments", "sampler", "batches", "step"):
        assert len({json.dumps(f[key]) for f in out}) == 1, key
    return out[0]


def flat(tree):
    return torch.tensor([v for k in sorted(tree) for v in tree[k]], dtype=torch.float64)


def test_sharded_job_matches_a_fixed_world_run_across_kill_scale_up_and_removal(fsdp_jobs):
    fixed, changing = fsdp_jobs
    assert sizes_in_order(fixed.steps()) == [4]
    assert sizes_in_order(changing.steps()) == [4, 3, 5, 4]
    a, b = finals(changing), finals(fixed)
    assert a["step"] == b["step"] == STEPS and a["size"] == 4
    assert a["batches"] == b["batches"]                       # the same global batches
    per_epoch = SAMPLES // GLOBAL_BATCH
    for start in range(0, len(a["batches"]), per_epoch):      # each sample once per epoch
        epoch = [i for batch in a["batches"][start:start + per_epoch] for i in batch]
        assert sorted(epoch) == list(range(SAMPLES))
    for key in ("params", "moments"):                         # AdamW's state too
        got, want = flat(a[key]), flat(b[key])
        assert float((got - want).norm() / want.norm()) < 1e-5, key
    assert "killed" in {p.name for p in changing.out.iterdir()}
    # The kill was recovered from the survivors' copies, and later changes resharded.
    records = changing.steps()
    assert max(r["builds"] for r in records) >= 4
    assert any(r["reshard_received"] > 0 for r in records if r["size"] == 5)


def test_unsupported_fsdp2_options_refused_and_a_commit_restored_in_place():
    """One process, a world of 1: mixed precision and an HSDP mesh are refused with one
    line; with reshard_after_forward=False a sync brings back the commit, optimizer too."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "workloads" / "fsdp_options.py")],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "mixed precision is not supported" in out["mixed_precision"]
    assert "1-D mesh" in out["hsdp"] and "\n" not in out["hsdp"]
    assert out["restored"] and out["step"] == 1 and out["moved"] == 0


def test_losing_more_shards_than_copied_resumes_from_the_sharded_checkpoint(fsdp_jobs, tmp_path,
                                                                          capsys):
    """3 workers write their shards (in the background); two are SIGKILLed at once, more
    than one copy covers: the survivor resumes from the checkpoint, resharded 3 -> 1 in
    place. A new job of 2 workers then resumes from the survivor's files (1 -> 2), reading
    only what it needs, and ends where the fixed 4-worker run does."""
    ckpt = tmp_path / "ckpt" / "sharded"          # elasticrun --checkpoint-dir's, by default
    first = Job(tmp_path / "a", ["-np", "3", "--min-np", "1", "--checkpoint-dir",
                                 str(tmp_path / "ckpt")], script=FSDP_JOB,
                hosts=["localhost:1", "127.0.0.1:2"],
                env={"FSDP_STEPS": str(STEPS // 2), "FSDP_KILL": "3:1+2"})
    assert first.run() == 0, first.output()[-4000:]
    assert sizes_in_order(first.steps()) == [3, 1]
    assert re.search(r"elastic: warning: no surviving worker holds the training state: "
                     r"shard\(s\) \[1\] of commit \d+ are lost .*; resuming from the newest "
                     r"sharded checkpoint \(commit \d+ of 3 shards\)", first.output()), \
        first.output()[-4000:]
    assert "of 3 shards" in finals(first)["resumed_from"]
    folders = sorted(p.name for p in ckpt.iterdir())
    assert folders[-1].endswith("-n1"), folders
    assert not list(ckpt.glob("*/*.tmp*"))
    # The newest commit's replicated part (its own blob) is corrupted: the rerun warns
    # once and resumes from the commit before it.
    newest, previous = [f for _v, _n, f in shard_files.whole(str(ckpt))[:2]]
    body = json.loads((Path(newest) / "shard0.json").read_text())["body"]
    blob = ckpt / "blobs" / body["rest"][0]
    blob.write_bytes(b"x" + blob.read_bytes()[1:])
    second = Job(tmp_path / "b", ["-np", "2", "-H", "localhost:2"], script=FSDP_JOB,
                 env={"FSDP_STEPS": str(STEPS), "FSDP_CKPT": str(ckpt)})
    assert second.run() == 0, second.output()[-4000:]
    a, b = finals(second), finals(fsdp_jobs[0])
    assert "of 1 shards" in a["resumed_from"] and a["size"] == 2
    assert a["resumed_from"].startswith(previous), a["resumed_from"]
    assert re.search(rf"elastic: warning: sharded checkpoint {re.escape(newest)} cannot be used "
                     r"\(.*fails its checksum\); trying the previous one", second.output())
    assert min(r["step"] for r in second.steps()) == STEPS // 2 + 1
    assert a["batches"] == b["batches"]
    for key in ("params", "moments"):
        got, want = flat(a[key]), flat(b[key])
        assert float((got - want).norm() / want.norm()) < 1e-5, key
    loaded_by_dcp_matches(ckpt, tmp_path, a, capsys)


def loaded_by_dcp_matches(ckpt, tmp_path, final, capsys):
    """The converter writes the last commit as a DCP checkpoint; DCP loads it into an
    ordinary (unsharded) model and AdamW, equal to the state the job gathered."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from elastic.state import dcp_export
    assert dcp_export.main([str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1
    assert capsys.readouterr().err.count("\n") == 1          # bad input: one line
    assert dcp_export.main([str(ckpt), str(tmp_path / "dcp")]) == 0
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "dcp"),
             no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    params = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
    moments = {f"{n}/{k}": v.flatten().tolist() for n, p in model.named_parameters()
               for k, v in optimizer.state[p].items() if k != "step"}
    assert flat(params).equal(flat(final["params"])) and flat(moments).equal(flat(final["moments"]))
    assert {float(s["step"]) for s in optimizer.state.values()} == {float(final["step"])}
    assert optimizer.param_groups[0]["lr"] == 0.01 and optimizer.param_groups[0]["weight_decay"] == 0.1


def test_losing_more_shards_than_copied_without_a_checkpoint_stops_with_one_line(tmp_path):
    """Redundancy 0: the SIGKILL of one of 2 workers loses its shard. The survivor never
    trains on without it: the job ends with one line and a non-zero exit."""
    job = Job(tmp_path, ["-np", "2", "--min-np", "1"], script=FSDP_JOB,
              hosts=["localhost:1", "127.0.0.1:1"],
              env={"FSDP_STEPS": str(STEPS), "FSDP_KILL": "2:1", "ELASTIC_SHARD_REDUNDANCY": "0"})
    code = job.run()
    out = job.output()
    assert code != 0, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"elasticrun: error: no surviving worker holds the training state: "
                        r"shard\(s\) \[1\] of commit (\d+) are lost \(more workers were lost "
                        r"than redundancy 0 covers\) and there is no sharded checkpoint to "
                        r"resume from; the last commit was \1", last), out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert max(r["step"] for r in job.steps()) == 1          # nothing trained after the loss
    assert not list(job.out.glob("final.*.json"))


@pytest.mark.parametrize("how", ["hosts removed", "SIGTERM"])
def test_more_workers_leaving_than_copied_hand_their_shards_off_first(fsdp_jobs, tmp_path, how):
    """Redundancy 1, no checkpoint: 2 of 3 workers leave at one commit (their host removed
    from discovery, or SIGTERM to both), more than one copy covers. They are alive at the
    commit where the round re-forms and hand the shards no stayer holds to the survivor
    before they go; it trains on from memory alone and ends where the fixed 4-worker run
    does."""
    env = {"FSDP_STEPS": str(STEPS), "ELASTIC_SHARD_REDUNDANCY": "1"}
    env.update({"FSDP_HOLD": "3:1"} if how == "hosts removed" else {"FSDP_TERM": "3:1+2"})
    job = Job(tmp_path, ["-np", "3", "--min-np", "1"], script=FSDP_JOB,
              hosts=["localhost:1", "127.0.0.1:2"], env=env).start()
    if how == "hosts removed":
        job.wait_step(3, size=3)
    else:                          # SIGTERM: the preempted host is not to come back later
        job.wait_step(4, size=1)
    job.set_hosts(["localhost:1"])
    assert job.finish() == 0, job.output()[-4000:]
    assert sizes_in_order(job.steps()) == [3, 1]
    assert "no surviving worker" not in job.output(), job.output()[-4000:]
    after = [r for r in job.steps() if r["size"] == 1]
    assert min(r["step"] for r in after) == 4                 # no committed step lost
    assert all(r["handed_off"] >= 1 for r in after)
    a, b = finals(job), finals(fsdp_jobs[0])
    assert a["batches"] == b["batches"]
    for key in ("params", "moments"):
        got, want = flat(a[key]), flat(b[key])
        assert float((got - want).norm() / want.norm()) < 1e-5, key


@pytest.mark.slow
def test_fsdp_example_goes_through_a_crash_and_a_scale_up(tmp_path):
    """examples/train_fsdp.py: 2 workers, the last one SIGKILLed at step 4 (the survivor
    goes on from its own shard and its copy of the other), then a host added: the
    newcomer receives its shard, and the loss still falls."""
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "--max-np", "2"],
              hosts=["localhost:1", "127.0.0.1:1"], script=REPO / "examples" / "train_fsdp.py",
              script_args=["--steps", "100000", "--crash-at-step", "4"]).start()
    job.wait_for(lambda: ": 1 workers, loss" in job.output(), "the survivor's steps")
    job.set_hosts(["localhost:1", "127.0.0.2:1"])
    job.wait_for(lambda: "step" in job.output().split(": 1 workers, loss")[-1] and
                 ": 2 workers, loss" in job.output().split(": 1 workers, loss")[-1],
                 "steps at 2 workers after the crash")
    job.proc.send_signal(signal.SIGTERM)                      # elasticrun stops the job
    job.finish()
    lines = [line for line in job.output().splitlines() if " workers, loss " in line]
    sizes = [int(line.split(": ")[1].split()[0]) for line in lines]
    assert sizes[0] == 2 and sizes[-1] == 2 and 1 in sizes, lines
    losses = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert losses[-1] < losses[0] / 2, lines
