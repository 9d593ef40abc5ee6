"""The discovery scripts in examples/discovery/, each run against a stub of its CLI.

A stub is a small executable shell script on PATH that prints canned output
(and records its arguments), so these tests need no cluster.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.jobs import Job, hosts_by_rank

from elastic.runner.discovery import parse_hosts

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "discovery"
LINE_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]+)?$")
_SETTINGS = ("SLURM_", "ELASTIC_K8S_", "ELASTIC_SPOT_", "SLOTS", "HOSTS_FILE", "PYTHON")


def stub(bin_dir, name, body):
    """An executable `name` in bin_dir: `#!/bin/sh` plus body."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def run_script(script, bin_dir, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(_SETTINGS)}
    base["PATH"] = os.pathsep.join([str(bin_dir), base.get("PATH", "/usr/bin:/bin"),
                                    os.path.dirname(sys.executable)])
    base.update(env)
    return subprocess.run([str(EXAMPLES / script)], env=base, capture_output=True, text=True,
                          timeout=30)


def hosts_of(proc):
    """The script succeeded and printed only host[:slots] lines; parse them."""
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert all(LINE_RE.match(line) for line in lines), proc.stdout
    return parse_hosts(proc.stdout)


def assert_one_line_failure(proc, script):
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"{script}: ") or proc.stderr.startswith(script), proc.stderr


# -- hosts file ---------------------------------------------------------------------------

def test_hosts_file(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# edited by an operator\nnode-1:4\n\nnode-2\n[fd00::3]:2\n")
    proc = run_script("hosts_file.sh", tmp_path / "bin", HOSTS_FILE=str(hosts))
    assert proc.returncode == 0
    assert parse_hosts(proc.stdout, default_slots=2) == {"node-1": 4, "node-2": 2, "fd00::3": 2}

    proc = run_script("hosts_file.sh", tmp_path / "bin", HOSTS_FILE=str(tmp_path / "missing"))
    assert_one_line_failure(proc, "hosts_file.sh")
    assert "cannot read hosts file" in proc.stderr


# -- Kubernetes ---------------------------------------------------------------------------

def pod(name, ip=None, phase="Running", ready=True, deleting=False):
    meta = {"name": name, "labels": {"app": "trainer"}}
    if deleting:
        meta["deletionTimestamp"] = "2024-06-01T00:00:00Z"
    status = {"phase": phase, "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


PODS = {"apiVersion": "v1", "kind": "List", "items": [
    pod("trainer-0", "10.1.0.10"),
    pod("trainer-1", "10.1.0.11", ready=False),               # not Ready yet
    pod("trainer-2", phase="Pending", ready=False),            # not scheduled, no IP
    pod("trainer-3", "10.1.0.13", deleting=True),              # terminating
    pod("trainer-4", "10.1.0.14", phase="Succeeded", ready=False),
    pod("trainer-5", "fd00::15"),                              # IPv6 pod IP
]}


def kubectl_stub(tmp_path, output=None, fail=None):
    args = tmp_path / "kubectl.args"
    canned = tmp_path / "pods.json"
    canned.write_text(output if output is not None else json.dumps(PODS))
    if fail:
        body = f'echo "{fail}" >&2\nexit 1\n'
    else:
        body = f'printf "%s\\n" "$@" > "{args}"\ncat "{canned}"\n'
    stub(tmp_path / "bin", "kubectl", body)
    return args


def test_kubernetes_lists_only_ready_pods(tmp_path):
    args = kubectl_stub(tmp_path)
    proc = run_script("kubernetes.sh", tmp_path / "bin", ELASTIC_K8S_SELECTOR="app=trainer",
                      ELASTIC_K8S_NAMESPACE="ml", SLOTS="2")
    assert hosts_of(proc) == {"10.1.0.10": 2, "fd00::15": 2}
    assert proc.stdout == "10.1.0.10:2\n[fd00::15]:2\n"
    assert args.read_text().split() == ["get", "pods", "-l", "app=trainer", "-o", "json",
                                        "-n", "ml"]
    # Slots default to 1.
    proc = run_script("kubernetes.sh", tmp_path / "bin", ELASTIC_K8S_SELECTOR="app=trainer")
    assert hosts_of(proc) == {"10.1.0.10": 1, "fd00::15": 1}


def test_kubernetes_no_ready_pods_prints_nothing(tmp_path):
    kubectl_stub(tmp_path, output=json.dumps({"items": [pod("a", "10.0.0.1", ready=False)]}))
    proc = run_script("kubernetes.sh", tmp_path / "bin", ELASTIC_K8S_SELECTOR="app=trainer")
    assert proc.returncode == 0 and proc.stdout == ""


def test_kubernetes_failures_are_one_line(tmp_path):
    kubectl_stub(tmp_path, fail="error: You must be logged in to the server (Unauthorized)")
    proc = run_script("kubernetes.sh", tmp_path / "bin", ELASTIC_K8S_SELECTOR="app=trainer")
    assert_one_line_failure(proc, "kubernetes.sh")
    assert "kubectl get pods failed (exit 1)" in proc.stderr and "Unauthorized" in proc.stderr

    kubectl_stub(tmp_path, output="<html>not json</html>")
    proc = run_script("kubernetes.sh", tmp_path / "bin", ELASTIC_K8S_SELECTOR="app=trainer")
    assert_one_line_failure(proc, "kubernetes.sh")

    proc = run_script("kubernetes.sh", tmp_path / "bin")
    assert_one_line_failure(proc, "kubernetes.sh")
    assert "ELASTIC_K8S_SELECTOR" in proc.stderr

    proc = run_script("kubernetes.sh", tmp_path / "bin", ELASTIC_K8S_SELECTOR="a=b", SLOTS="x")
    assert_one_line_failure(proc, "kubernetes.sh")


# -- Slurm --------------------------------------------------------------------------------

def scontrol_stub(tmp_path, hosts=("node-1", "node-2", "node-3"), fail=None):
    args = tmp_path / "scontrol.args"
    if fail:
        body = f'echo "{fail}" >&2\nexit 1\n'
    else:
        lines = "\\n".join(hosts)
        body = (f'printf "%s\\n" "$@" > "{args}"\n'
                '[ "$1" = show ] && [ "$2" = hostnames ] || exit 2\n'
                f'printf "{lines}\\n"\n')
    stub(tmp_path / "bin", "scontrol", body)
    return args


def test_slurm_expands_the_node_list(tmp_path):
    args = scontrol_stub(tmp_path)
    proc = run_script("slurm.sh", tmp_path / "bin", SLURM_JOB_NODELIST="node-[1-3]",
                      SLURM_NTASKS_PER_NODE="4")
    assert hosts_of(proc) == {"node-1": 4, "node-2": 4, "node-3": 4}
    assert args.read_text().split() == ["show", "hostnames", "node-[1-3]"]
    proc = run_script("slurm.sh", tmp_path / "bin", SLURM_JOB_NODELIST="node-[1-3]")
    assert proc.stdout == "node-1:1\nnode-2:1\nnode-3:1\n"


def test_slurm_failures_are_one_line(tmp_path):
    scontrol_stub(tmp_path, fail="scontrol: error: Invalid hostlist: node-[1-")
    proc = run_script("slurm.sh", tmp_path / "bin", SLURM_JOB_NODELIST="node-[1-")
    assert_one_line_failure(proc, "slurm.sh")
    assert "scontrol show hostnames failed (exit 1)" in proc.stderr
    assert "Invalid hostlist" in proc.stderr

    proc = run_script("slurm.sh", tmp_path / "bin")
    assert_one_line_failure(proc, "slurm.sh")
    assert "SLURM_JOB_NODELIST is not set" in proc.stderr

    proc = run_script("slurm.sh", tmp_path / "bin", SLURM_JOB_NODELIST="n1",
                      SLURM_NTASKS_PER_NODE="2(x3)")
    assert_one_line_failure(proc, "slurm.sh")


# -- spot instances -----------------------------------------------------------------------

INSTANCES = "10.0.1.1\tNone\n10.0.1.2\t1718000000\n10.0.1.3\tNone\nNone\tNone\n10.0.1.5\tyes\n"


def aws_stub(tmp_path, output=INSTANCES, fail=None):
    args = tmp_path / "aws.args"
    canned = tmp_path / "instances.txt"
    canned.write_text(output)
    if fail:
        body = f'echo "{fail}" >&2\nexit 254\n'
    else:
        body = f'printf "%s\\n" "$@" > "{args}"\ncat "{canned}"\n'
    stub(tmp_path / "bin", "aws", body)
    return args


def test_spot_drops_hosts_marked_for_reclaim(tmp_path):
    args = aws_stub(tmp_path)
    proc = run_script("spot.sh", tmp_path / "bin", ELASTIC_SPOT_JOB="run-42", SLOTS="8")
    # 10.0.1.2 and 10.0.1.5 carry the reclaim tag; one instance has no IP yet.
    assert hosts_of(proc) == {"10.0.1.1": 8, "10.0.1.3": 8}
    called = args.read_text().splitlines()
    assert called[:2] == ["ec2", "describe-instances"]
    assert "Name=tag:elastic-job,Values=run-42" in called
    assert "Name=instance-state-name,Values=running" in called
    assert any("spot-reclaim" in a for a in called)
    assert called[called.index("--output") + 1] == "text"


def test_spot_failures_are_one_line(tmp_path):
    aws_stub(tmp_path, fail="An error occurred (UnauthorizedOperation) when calling the "
                            "DescribeInstances operation: You are not authorized")
    proc = run_script("spot.sh", tmp_path / "bin", ELASTIC_SPOT_JOB="run-42")
    assert_one_line_failure(proc, "spot.sh")
    assert "describe-instances failed (exit 254)" in proc.stderr
    assert "UnauthorizedOperation" in proc.stderr

    proc = run_script("spot.sh", tmp_path / "bin")
    assert_one_line_failure(proc, "spot.sh")
    assert "ELASTIC_SPOT_JOB" in proc.stderr


# -- end to end ---------------------------------------------------------------------------

@pytest.mark.slow
def test_elasticrun_job_driven_by_the_slurm_example(tmp_path):
    scontrol_stub(tmp_path, hosts=("localhost", "127.0.0.1"))
    path = os.pathsep.join([str(tmp_path / "bin"), os.environ.get("PATH", "/usr/bin:/bin")])
    job = Job(tmp_path, ["-np", "2", "--host-discovery-script", str(EXAMPLES / "slurm.sh"),
                         "--discovery-interval", "0.3"],
              env={"PATH": path, "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
                   "JOB_EPOCHS": "1"})
    job.assert_ok(job.run(), epochs=1, final_size=2)
    assert hosts_by_rank(job.steps(), 1) == {0: "localhost", 1: "127.0.0.1"}
