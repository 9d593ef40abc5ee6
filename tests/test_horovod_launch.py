"""horovodrun's flags for elasticrun and horovod.run's keywords for elastic.launch."""

import os
import subprocess
import sys

import pytest
import torch

import elastic
from elastic.launching import client
from elastic.runner import cli, horovod_flags
from elastic.training.optimizer import DistributedOptimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(argv, monkeypatch=None):
    return cli.config_from_args(cli.build_parser().parse_args(argv + ["--", "true"]))


def _main(argv, env=None):
    """elasticrun in a subprocess: (exit code, stderr)."""
    full = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    r = subprocess.run([sys.executable, "-m", "elastic.runner", *argv], env=full,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr


def test_hostfile_in_horovods_format(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nlocalhost slots=2\n127.0.0.1 slots=1  # a comment\n"
                        "\n127.0.0.2:3\n")
    for flag in ("--hostfile", "-hostfile"):
        config = _config(["-np", "2", flag, str(hostfile)])
        assert config.discovery.discover() == {"localhost": 2, "127.0.0.1": 1, "127.0.0.2": 3}
    for text, words in (("localhost slots=x\n", "slots must be"), ("a b c\n", "host slots=N"),
                        ("# nothing\n", "no hosts")):
        hostfile.write_text(text)
        with pytest.raises(cli.UsageError, match=words):
            _config(["-np", "1", "--hostfile", str(hostfile)])
    with pytest.raises(cli.UsageError, match="only one of"):
        _config(["-np", "1", "--hostfile", str(hostfile), "-H", "localhost:1"])
    with pytest.raises(cli.UsageError, match="No such file"):
        _config(["-np", "1", "--hostfile", str(tmp_path / "missing")])


def test_start_timeout_flag_and_variable(monkeypatch):
    monkeypatch.delenv(horovod_flags.START_TIMEOUT_ENV, raising=False)
    assert _config(["-np", "1"]).start_timeout is None
    assert _config(["-np", "1", "--start-timeout", "45"]).start_timeout == 45.0
    monkeypatch.setenv(horovod_flags.START_TIMEOUT_ENV, "70")
    assert _config(["-np", "1"]).start_timeout == 70.0
    assert _config(["-np", "1", "--start-timeout", "5"]).start_timeout == 5.0
    monkeypatch.setenv(horovod_flags.START_TIMEOUT_ENV, "soon")
    with pytest.raises(cli.UsageError, match="HOROVOD_START_TIMEOUT"):
        _config(["-np", "1"])
    monkeypatch.delenv(horovod_flags.START_TIMEOUT_ENV)
    with pytest.raises(cli.UsageError, match="positive"):
        _config(["-np", "1", "--start-timeout", "0"])


def test_fusion_threshold_is_the_bucket_size(monkeypatch):
    config = _config(["-np", "1", "--fusion-threshold-mb", "4"])
    assert config.extra_env[horovod_flags.FUSION_ENV] == str(4 * 2 ** 20)
    model = torch.nn.Linear(4, 4)
    monkeypatch.setenv(horovod_flags.FUSION_ENV, str(4 * 2 ** 20))
    assert DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).bucket_cap_bytes == 4 * 2 ** 20
    monkeypatch.setenv(horovod_flags.FUSION_ENV, "0")     # Horovod: no fusion
    assert DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).bucket_cap_bytes == 1
    assert DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                bucket_cap_mb=2).bucket_cap_bytes == 2 * 2 ** 20   # explicit wins
    monkeypatch.setenv(horovod_flags.FUSION_ENV, "lots")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_meaningless_flags_and_variables_warn_once_each():
    argv = ["-np", "1", "--gloo", "--mpi", "--disable-cache", "--timeline-filename", "t.json",
            "--autotune", "--autotune-log-file", "a.csv", "--cycle-time-ms", "1",
            "--cache-capacity", "0", "--hierarchical-allreduce"]
    args = cli.build_parser().parse_args(argv + ["--", "true"])
    lines = horovod_flags.warnings_for(args, {"HOROVOD_CYCLE_TIME": "5", "HOROVOD_AUTOTUNE": "1",
                                              "HOROVOD_FUSION_THRESHOLD": "1"})
    flags = [a for a in argv if a.startswith("--")]
    assert len(lines) == len(flags) + 2
    for flag in flags + ["HOROVOD_CYCLE_TIME", "HOROVOD_AUTOTUNE"]:
        assert sum(1 for line in lines if line.startswith(f"warning: {flag} ignored")) == 1
    assert horovod_flags.warnings_for(cli.build_parser().parse_args(["-np", "1", "true"]),
                                      {}) == []


@pytest.mark.slow
def test_elasticrun_warns_and_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import elastic\nelastic.init()\nprint('rank', elastic.rank())\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    code, err = _main(["-np", "2", "-hostfile", str(hostfile), "--gloo", "--timeline-filename",
                       str(tmp_path / "t.json"), "--start-timeout", "60", "--cycle-time-ms", "2",
                       sys.executable, str(script)], env={"HOROVOD_CACHE_CAPACITY": "0"})
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 4, err
    assert "job finished: 2 workers exited 0" in err


# -- elastic.launch with horovod.run's keywords ---------------------------------------------------
def test_horovod_run_keywords_become_our_flags(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    np, min_np, max_np, script, options = client.horovod_keywords(
        1, None, None, None,
        {"num_proc": 2, "min_num_proc": 1, "max_num_proc": 3, "hostfile": str(hostfile),
         "start_timeout": None, "cooldown_range": (1, 5), "use_gloo": False, "use_mpi": None,
         "disable_cache": None, "verbose": 2, "reset_limit": None, "ssh_port": None,
         "slots": None, "executable": None})
    assert (np, min_np, max_np, script) == (2, 1, 3, None)
    assert options == {"hostfile": str(hostfile), "blacklist_cooldown_range": (1, 5),
                       "verbose": True}
    flags = client.elasticrun_flags(np, min_np, max_np, None, script, options)
    cli.config_from_args(cli.build_parser().parse_args(flags + ["--", "true"]))   # valid
    assert "--hostfile" in flags and "--blacklist-cooldown-range" in flags
    assert client.horovod_keywords(1, None, None, None, {"host_discovery_script": "d.sh"})[3] \
        == "d.sh"
    assert client.horovod_keywords(1, None, None, None, {"use_gloo": True})[4] == {"gloo": True}
    with pytest.raises(TypeError, match="not both"):
        client.horovod_keywords(2, None, None, None, {"num_proc": 3})
    with pytest.raises(TypeError, match="not both"):
        client.horovod_keywords(1, 1, None, None, {"min_num_proc": 2})
    with pytest.raises(ValueError, match="executable"):
        client.horovod_keywords(1, None, None, None, {"executable": "/usr/bin/python2"})


def _size_and_rank():
    return elastic.size(), elastic.rank()


@pytest.mark.slow
def test_launch_with_horovod_run_keywords(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    got = elastic.launch(_size_and_rank, num_proc=2, min_num_proc=2, hostfile=str(hostfile),
                         start_timeout=None, use_gloo=False, use_mpi=None, disable_cache=None,
                         cooldown_range=None, verbose=None, quiet=True, timeout=120)
    assert got == [(2, 0), (2, 1)]
