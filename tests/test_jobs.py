"""Elastic jobs with real processes, real gloo groups and real signals.

localhost and 127.0.0.1 act as two hosts. Every test checks ranks, sizes and
hosts per round, bitwise-equal parameters and optimizer state on all ranks at
the end, and that the committed history trains each sample exactly once.
"""

import socket
import time

import pytest
from support.jobs import REPO, Job, hosts_by_rank, sizes_in_order

pytestmark = pytest.mark.slow
THIRD_HOST = socket.gethostname()   # a third name for this machine: launched locally


def test_fixed_hosts_train_to_the_end(tmp_path):
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:1,127.0.0.1:1",
                         "--output-filename", str(tmp_path / "logs")])
    finals = job.assert_ok(job.run(), final_size=2)
    records = job.steps()
    assert sizes_in_order(records) == [2]
    assert hosts_by_rank(records, 1) == {0: "localhost", 1: "127.0.0.1"}
    assert finals[0]["step"] == 3 * 48 // 8
    # No --checkpoint-dir: one warning, after the first round (bad input stays one line).
    assert job.output().count("no --checkpoint-dir") == 1, job.output()
    # ELASTIC_* hold the first round's values; one file per worker under --output-filename.
    for env in job.worker_envs():
        assert env["joined"]["ELASTIC_RANK"] == str(env["rank"])
        assert env["joined"]["ELASTIC_SIZE"] == "2"
        assert env["joined"]["ELASTIC_HOSTNAME"] == hosts_by_rank(records, 1)[env["rank"]]
    logs = sorted(p.parent.name for p in (tmp_path / "logs").glob("worker.*/stdout"))
    assert logs == ["worker.0", "worker.1"]
    assert "finished as rank" in (tmp_path / "logs" / "worker.0" / "stdout").read_text()


def test_host_appearing_during_start_up_is_not_lost(tmp_path):
    job = Job(tmp_path, ["-np", "1", "--max-np", "2"], hosts=["localhost:1"],
              env={"JOB_HOLD": "2"}).start()
    # The first worker is still importing torch: the new host must still get in.
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    job.wait_for(lambda: any(r["size"] == 2 for r in job.steps()), "both hosts training")
    job.release(2)
    job.assert_ok(job.finish(), final_size=2)


def test_newcomer_dying_before_ready_does_not_disturb_training(tmp_path):
    job = Job(tmp_path, ["-np", "1", "--max-np", "2"], hosts=["localhost:1"],
              env={"JOB_HOLD": "3", "JOB_DIE_ON_HOST": "127.0.0.1"}).start()
    job.wait_step(3)
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    job.wait_for(lambda: "blacklisting host 127.0.0.1" in job.output(), "the newcomer's failure")
    job.release(3)
    job.assert_ok(job.finish(), final_size=1)
    assert sizes_in_order(job.steps()) == [1]
    assert "restoring the last commit" not in job.output()


def test_hosts_added(tmp_path):
    job = Job(tmp_path, ["-np", "2", "--max-np", "4"], hosts=["localhost:2"],
              env={"JOB_HOLD": "3"}).start()
    job.wait_step(3)
    job.set_hosts(["localhost:2", "127.0.0.1:2"])
    job.wait_step(4, size=4)
    job.assert_ok(job.finish(), final_size=4)
    records = job.steps()
    assert sizes_in_order(records) == [2, 4]
    grown = max(r["round"] for r in records)
    assert hosts_by_rank(records, grown) == {0: "localhost", 1: "localhost",
                                             2: "127.0.0.1", 3: "127.0.0.1"}
    assert "restoring the last commit" not in job.output()


def test_hosts_removed_gracefully(tmp_path):
    job = Job(tmp_path, ["-np", "4", "--min-np", "2"], hosts=["localhost:2", "127.0.0.1:2"],
              env={"JOB_HOLD": "3"}).start()
    job.wait_step(3)
    job.set_hosts(["127.0.0.1:2"])
    job.wait_step(4, size=2)
    job.assert_ok(job.finish(), final_size=2)
    records = job.steps()
    assert sizes_in_order(records) == [4, 2]
    shrunk = max(r["round"] for r in records)
    assert set(hosts_by_rank(records, shrunk).values()) == {"127.0.0.1"}
    # Removed workers left cleanly at a commit: no failure, no blacklisting, no restore.
    assert "blacklisting" not in job.output()
    assert "restoring the last commit" not in job.output()
    assert job.output().count("not a member of round") == 2


@pytest.mark.parametrize("fault,survivor_host", [
    ("5:1:raise", "127.0.0.1"),     # an exception in one rank
    ("5:2:kill", "localhost"),      # SIGKILL of a rank
    ("5:0:kill", "127.0.0.1"),      # SIGKILL of rank 0
])
def test_a_failed_rank_blacklists_its_host_and_training_goes_on(tmp_path, fault, survivor_host):
    job = Job(tmp_path, ["-np", "4", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2"],
              env={"JOB_FAULT": fault, "JOB_COMMIT_EVERY": "2"})
    job.assert_ok(job.run(), final_size=2)
    records = job.steps()
    assert sizes_in_order(records)[0] == 4 and sizes_in_order(records)[-1] == 2
    last = max(r["round"] for r in records)
    assert set(hosts_by_rank(records, last).values()) == {survivor_host}
    assert "blacklisting host" in job.output()


def test_all_ranks_failing_fails_the_job(tmp_path):
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:2"], env={"JOB_FAULT": "3:*:exit"})
    code = job.run()
    assert code != 0
    errors = [line for line in job.output().splitlines() if line.startswith("elasticrun: error:")]
    assert len(errors) == 1, job.output()
    assert "Traceback" not in "\n".join(line for line in job.output().splitlines()
                                        if not line.startswith("["))


def test_one_rank_per_host_failing_blacklists_every_host(tmp_path):
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
              env={"JOB_FAULT": "3:0:exit;6:0:exit"})
    code = job.run()
    assert code != 0
    out = job.output()
    assert out.count("blacklisting host") == 2, out
    assert "elasticrun: error:" in out


@pytest.mark.parametrize("limit,ok", [(1, False), (2, True)])
def test_reset_limit(tmp_path, limit, ok):
    job = Job(tmp_path, ["-np", "3", "--min-np", "1", "--reset-limit", str(limit),
                         "-H", f"localhost:1,127.0.0.1:1,{THIRD_HOST}:1"],
              env={"JOB_FAULT": "3:2:exit;7:1:exit"})
    code = job.run()
    if ok:
        job.assert_ok(code, final_size=1)
        assert sizes_in_order(job.steps()) == [3, 2, 1]
    else:
        assert code != 0
        assert "reset limit 1 reached" in job.output()


def test_min_np_not_reached_at_start_fails_after_the_timeout(tmp_path):
    job = Job(tmp_path, ["-np", "3", "--elastic-timeout", "3", "-H", "localhost:2"])
    began = time.monotonic()
    code = job.run()
    elapsed = time.monotonic() - began
    assert code != 0
    assert "--elastic-timeout 3" in job.output()
    assert elapsed < 60, elapsed    # generous: about the timeout, never a hang


def test_min_np_lost_mid_job_fails_after_the_timeout(tmp_path):
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--elastic-timeout", "3",
                         "-H", "localhost:1,127.0.0.1:1"], env={"JOB_FAULT": "3:1:kill"})
    code = job.run()
    assert code != 0
    assert "to continue" in job.output(), job.output()


def test_cooldown_brings_a_blacklisted_host_back(tmp_path):
    job = Job(tmp_path, ["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "2",
                         "-H", "localhost:1,127.0.0.1:1"],
              env={"JOB_FAULT": "3:1:exit", "JOB_HOLD": "5"}).start()
    job.wait_step(5, size=1)
    job.wait_for(lambda: sizes_in_order(job.steps())[-1:] == [2] and
                 len(sizes_in_order(job.steps())) >= 3, "the host to come back")
    job.release(5)
    job.assert_ok(job.finish(), final_size=2)
    assert sizes_in_order(job.steps())[:2] == [2, 1]
    assert "back from the blacklist" in job.output()


def test_a_final_round_worker_failing_before_the_others_finish_fails_the_job(tmp_path):
    job = Job(tmp_path, ["-np", "2", "-H", "localhost:1,127.0.0.1:1"],
              script=REPO / "tests" / "workloads" / "exit_after_training.py")
    code = job.run()
    assert code != 0, job.output()
    assert "exited with code 4" in job.output()


def test_a_failure_while_re_initialising_is_recovered_without_blacklisting(tmp_path):
    job = Job(tmp_path, ["-np", "2", "--max-np", "4"], hosts=["localhost:2"],
              env={"JOB_HOLD": "3", "JOB_RESET_FAULT": "1"}).start()
    job.wait_step(3)
    job.set_hosts(["localhost:2", "127.0.0.1:2"])
    job.wait_step(4, size=4)
    job.assert_ok(job.finish(), final_size=4)
    assert (job.out / "reset_fault.fired").exists()
    out = job.output()
    assert "injected failure during re-initialisation" in out
    assert "blacklisting" not in out and "exited with code" not in out


def test_a_later_discovery_failure_warns_and_keeps_the_hosts(tmp_path):
    job = Job(tmp_path, ["-np", "2"], hosts=["localhost:1", "127.0.0.1:1"],
              env={"JOB_HOLD": "3"}).start()
    job.wait_step(3)
    job.set_hosts(["this is not a host line"])
    job.wait_for(lambda: "keeping the last host set" in job.output(), "the discovery warning")
    job.release(3)
    job.assert_ok(job.finish(), final_size=2)
    assert sizes_in_order(job.steps()) == [2]
