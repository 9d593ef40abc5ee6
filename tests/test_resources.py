"""Resources stay bounded across membership changes (DESIGN §4, issue 10).

Real worker processes on real gloo groups; the test plays the driver
(tests/support/harness.py), which makes a change cost a fraction of a second instead
of a process start. Every other change aborts the round while rank 0 waits in
an allreduce on a slow rank 1, so work abandoned in flight must drain before
its group can be freed; the others are graceful (a new round at a commit).
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support.harness import REPO, Workers  # noqa: E402
from support.procs import resource_growth, resources  # noqa: E402

from elastic.protocol import Keys  # noqa: E402

WORKER = REPO / "tests" / "workloads" / "churn_worker.py"
CHANGES = 100


@pytest.mark.slow
def test_fds_threads_rss_stay_bounded_over_100_membership_changes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with Workers(WORKER, 2, tmp_path, extra_env={"CHURN_OUT": str(out)}, timeout=120) as job:
        rank0 = job.procs[0].pid
        cs = job.control

        def change(round_id, abort):
            if abort:
                (out / "slow").touch()
                job.abort(round_id - 1)
                # Each worker gives the aborted round up (it reports no failure of its own:
                # it saw none, rounds.round_aborted).
                job.wait_for(lambda: all(f"round {round_id - 1} failed (" in
                                         (job.out_dir / f"{w}.err").read_text() for w in job.ids),
                             f"round {round_id - 1} to be given up")
                (out / "slow").unlink()
            job.publish(round_id)
            # Rank 0 reports the pause once the round formed and synced: training resumed.
            job.wait_for(lambda: cs.has(Keys.pause(round_id)), f"round {round_id}")

        job.wait_for(lambda: all(cs.has(Keys.joined(1, w)) for w in job.ids), "round 1")
        change(2, abort=False)
        first = resources(rank0)
        readings = [first]
        for round_id in range(3, CHANGES + 2):
            change(round_id, abort=round_id % 2 == 1)
            readings.append(resources(rank0))
        last = resources(rank0)
        (out / "stop").touch()
        results = job.finish()
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    done = [json.loads((out / f"done.{r}.json").read_text()) for r in range(2)]
    growth = resource_growth(first, last)
    print(f"groups: {done}")
    print(f"after change 1: {first}; after {CHANGES}: {last}; growth {growth}")
    assert growth["fds"] <= 20, (first, last, readings[::10])
    assert growth["threads"] <= 10, (first, last, readings[::10])
    assert growth["rss"] <= 1.10, (first, last, readings[::10])
    for d in done:
        # Every past round's group was freed, some only after work abandoned in flight drained.
        assert d["released"] + d["retired_now"] >= CHANGES, done
        assert d["retired_now"] <= 2, done
    assert any(d["waited"] > 0 for d in done), done
