"""Network faults between hosts of their own (tests/support/netlab.py): the driver and each
worker host in its own network namespace on one bridge, workers started through
elasticrun's remote path. Skipped, with one reason, where namespaces are refused."""

import subprocess
import time

import pytest
from support.netlab import Unsupported, lab, lab_job  # noqa: F401  (lab: the fixture)

pytestmark = pytest.mark.slow

DRIVER_CUT_S = 40


def driver_lines(job):
    return [line for line in job.output().splitlines() if line.startswith("elasticrun:")]


def test_the_drivers_link_down_for_40_s_then_up_the_job_finishes_and_nobody_is_blacklisted(
        lab, tmp_path):  # noqa: F811
    """Every heartbeat stops at once: the driver takes it for its own network, evicts
    nobody, and the workers (whose store calls wait and reconnect) go on once it is back."""
    driver, a, b = lab.host("driver"), lab.host("a"), lab.host("b")
    job = lab_job(tmp_path, lab, driver, ["-np", "2", "-H", f"{a.addr}:1,{b.addr}:1",
                                          "--worker-timeout", "10"],
                  env={"JOB_HOLD": "3", "JOB_EPOCHS": "2"}).start()
    try:
        job.wait_step(3)
        lab.link_down(driver)
        cut_at = time.monotonic()
        job.wait_for(lambda: "every heartbeat stopped at once" in job.output(),
                     "the driver to see every heartbeat stop at once", timeout=120)
        while time.monotonic() - cut_at < DRIVER_CUT_S:     # the fault's length, not a check
            time.sleep(0.5)
        lab.link_up(driver)
        job.wait_for(lambda: "heartbeats are back" in job.output(), "heartbeats to come back",
                     timeout=180)
        job.release(3)
        code = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    job.assert_ok(code, epochs=2, final_size=2)
    lines = driver_lines(job)
    assert not any("blacklisting" in line or "sent no heartbeat" in line for line in lines), lines
    assert "every heartbeat stopped at once" in job.output()


@pytest.mark.parametrize("one_way", [False, True], ids=["both-ways", "one-way"])
def test_a_worker_cut_from_the_store_but_not_from_its_peers_is_evicted_and_the_rest_go_on(
        lab, tmp_path, one_way):  # noqa: F811
    """Host c loses the driver (blackhole routes; one way: only c's packets to the
    driver are dropped) while a and b still reach it and c still reaches its peers:
    c is evicted after --worker-timeout and blacklisted, a and b finish the job."""
    driver, a, b, c = lab.host("driver"), lab.host("a"), lab.host("b"), lab.host("c")
    job = lab_job(tmp_path, lab, driver, ["-np", "3", "--min-np", "2",
                                          "-H", f"{a.addr}:1,{b.addr}:1,{c.addr}:1",
                                          "--worker-timeout", "10"],
                  env={"JOB_HOLD": "3", "JOB_EPOCHS": "2"}).start()
    try:
        job.wait_step(3, size=3)
        lab.cut(c, driver, one_way=one_way)
        job.wait_for(lambda: f"blacklisting host {c.addr}" in job.output(),
                     f"host {c.addr} to be blacklisted", timeout=180)
        job.release(3)
        code = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    job.assert_ok(code, epochs=2, final_size=2)
    lines = driver_lines(job)
    assert any(f"on {c.addr} sent no heartbeat" in line for line in lines), lines
    assert not any(f"blacklisting host {h.addr}" in line for h in (a, b) for line in lines), \
        lines
    assert "every heartbeat stopped at once" not in job.output()


def test_delay_and_loss_on_one_workers_link_evict_nobody(lab, tmp_path):  # noqa: F811
    driver, a, b = lab.host("driver"), lab.host("a"), lab.host("b")
    try:
        lab.netem(b, "delay", "50ms", "10ms", "loss", "2%")
    except Unsupported as exc:
        pytest.skip(str(exc))
    job = lab_job(tmp_path, lab, driver, ["-np", "2", "-H", f"{a.addr}:1,{b.addr}:1"],
                  env={"JOB_EPOCHS": "2"})
    code = job.run()
    job.assert_ok(code, epochs=2, final_size=2)
    assert "evict" not in job.output()


def test_a_host_partitioned_from_its_peers_while_all_reach_the_store_is_blamed(
        lab, tmp_path):  # noqa: F811
    """Host c loses its links to a and b (blackhole routes both ways) but still reaches
    the driver: the round cannot form with it, the repeating group error is decided
    (issue 26, part 1): c is blamed and blacklisted, a and b finish the job."""
    driver, a, b, c = lab.host("driver"), lab.host("a"), lab.host("b"), lab.host("c")
    job = lab_job(tmp_path, lab, driver, ["-np", "3", "--min-np", "2",
                                          "-H", f"{a.addr}:1,{b.addr}:1,{c.addr}:1",
                                          "--worker-timeout", "10", "--stall-timeout", "20"],
                  env={"JOB_HOLD": "3", "JOB_EPOCHS": "2", "ELASTIC_COLLECTIVE_TIMEOUT": "15"}
                  ).start()
    try:
        job.wait_step(3, size=3)
        lab.cut(c, a)
        lab.cut(c, b)
        job.release(3)
        job.wait_for(lambda: f"blacklisting host {c.addr}" in job.output(),
                     f"host {c.addr} to be blacklisted", timeout=240)
        code = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    job.assert_ok(code, epochs=2, final_size=2)
    lines = driver_lines(job)
    assert not any(f"blacklisting host {h.addr}" in line for h in (a, b) for line in lines), \
        lines


def test_the_net_bench_lab_shapes_each_direction_and_leaves_no_namespace_behind():
    """`make bench-net`'s lab (benchmarks/net_bench.py): tbf on a host's eth0 limits what
    it sends, on its bridge port what it receives; unshaping removes it; close() deletes
    every namespace it made."""
    import sys
    from pathlib import Path

    from support.netlab import why_no_lab
    reason = why_no_lab()
    if reason:
        pytest.skip(reason)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import net_bench

    def qdisc(ns, dev):
        return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                              text=True, timeout=30).stdout

    def namespaces():
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                              timeout=30).stdout

    made = net_bench.NetLab(2)
    ours = [h.ns for h in made.hosts] + [made.ctl.ns, made.lab.switch]
    try:
        assert all(ns in namespaces() for ns in ours)
        made.shape(up="300mbit", down="600mbit")
        for host in made.hosts:
            assert "tbf" in qdisc(host.ns, "eth0") and "300Mbit" in qdisc(host.ns, "eth0")
            assert "600Mbit" in qdisc(made.lab.switch, host.port)
        made.shape(hosts=made.hosts[:1])
        assert "tbf" not in qdisc(made.hosts[0].ns, "eth0")
        assert "tbf" not in qdisc(made.lab.switch, made.hosts[0].port)
        assert "tbf" in qdisc(made.hosts[1].ns, "eth0")
    finally:
        made.close()
    left = namespaces()
    assert not any(ns in left for ns in ours), left
