"""elasticrun's own flags, horovodrun's flags and --config-file (issue 30, part 5).

Everything runs ``cli.main`` in this process with ``--dry-run`` (or
``--version``/``--check-build``), which parses, validates and plans exactly as
a real start does and then prints the plan instead of starting workers. A real
job with a training command full of our flags' prefixes is in
tests/test_root_cause.py, which starts one anyway.
"""

import re
import sys
from pathlib import Path

import pytest

import elastic
from elastic.runner import cli, horovod_flags, stalls

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def plan(capsys, flags, command=(PY, "train.py")):
    code, out, err = run(capsys, list(flags) + ["--dry-run"] + list(command))
    assert code == 0, err
    return out, err


# -- the training command is never parsed as ours --------------------------------------------
COMMANDS = [
    ["--n", "3"],                        # prefix of --network-interface, --num-proc, ...
    ["--min", "1"],                      # prefix of --min-np and --min-num-proc
    ["--max", "9", "--host", "x"],
    ["-np", "7", "-H", "nowhere:1"],     # our own short flags, exactly
    ["--verbose", "--dry"],              # ours exactly, and a prefix of --dry-run
    ["-i", "key", "-p", "22", "-v"],
    ["--", "--version"],                 # a -- that belongs to the command
    ["--stall-timeout=0", "--config-file", "/nonexistent"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_arguments_after_the_command_are_the_commands(capsys, args):
    out, _ = plan(capsys, ["-np", "2"], [PY, "train.py", *args])
    assert f"command: {PY} train.py {' '.join(args)}\n" in out


def test_a_double_dash_still_starts_the_command(capsys):
    code, out, err = run(capsys, ["-np", "1", "--dry-run", "--", PY, "-c", "pass", "--n", "1"])
    assert code == 0 and f"command: {PY} -c pass --n 1\n" in out, err


def test_our_flags_may_still_be_abbreviated_before_the_command(capsys):
    out, _ = plan(capsys, ["-np", "2", "--max-num", "3", "--worker-time", "7"])
    assert "--max-np 3" in out and "--worker-timeout 7 s" in out


def test_an_unknown_flag_before_the_command_is_still_an_error(capsys):
    code, _, err = run(capsys, ["-np", "1", "--no-such-flag", PY, "x.py"])
    assert code == 2 and err.startswith("elasticrun: error:") and "--no-such-flag" in err


# -- --version, --check-build, --dry-run -------------------------------------------------------
def test_version(capsys):
    code, out, _ = run(capsys, ["--version"])
    assert code == 0 and out == f"elasticrun {elastic.__version__}\n"


def test_check_build_says_what_this_installation_runs(capsys):
    code, out, _ = run(capsys, ["--check-build"])
    assert code == 0
    assert "[X] PyTorch" in out and "[X] Gloo" in out and "[ ] MPI" in out


def test_dry_run_prints_hosts_slots_first_round_and_binding(capsys, tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\necho 127.0.0.1:1\n")
    script.chmod(0o755)
    out, _ = plan(capsys, ["-np", "2", "--max-np", "2", "--host-discovery-script", str(script)])
    assert "hosts: 2 with 3 slots\n" in out
    assert "  localhost: 2 slots (local)\n" in out and "  127.0.0.1: 1 slot (local)\n" in out
    assert "first round: 2 workers\n" in out
    assert "  rank 0: localhost slot 0 (local rank 0)\n" in out
    assert "  rank 1: localhost slot 1 (local rank 1)\n" in out
    assert "control store: listens on 127.0.0.1, port any free one (every host is local)" in out


def test_dry_run_says_when_the_first_round_would_wait(capsys):
    out, _ = plan(capsys, ["-np", "4", "-H", "localhost:2", "--elastic-timeout", "30"])
    assert "first round: waits up to --elastic-timeout 30 s for 4 slots (2 found)" in out


def test_dry_run_starts_nothing_for_bad_input(capsys):
    code, out, err = run(capsys, ["-np", "0", "--dry-run", PY])
    assert code == 2 and out == "" and err.startswith("elasticrun: error: -np")


# -- horovodrun's flags: each one the docs list is accepted ----------------------------------
def _horovod_flags_in_docs():
    """The horovodrun flags docs/horovod.md says elasticrun takes."""
    text = (REPO / "docs" / "horovod.md").read_text()
    section = text.split("**API by API**")[0]
    return set(re.findall(r"`(-{1,2}[a-z][a-z0-9-]*)", section))


HOROVOD_FLAGS = {
    "-np": ["-np", "1"], "--num-proc": ["--num-proc", "1"],
    "--min-num-proc": ["--min-num-proc", "1"], "--max-num-proc": ["--max-num-proc", "2"],
    "-H": ["-H", "localhost:1"], "--hosts": ["--hosts", "localhost:1"],
    "--host-discovery-script": ["--host-discovery-script", "{discover}"],
    "--slots": ["--slots", "1", "--host-discovery-script", "{discover}"],
    "--elastic-timeout": ["--elastic-timeout", "60"], "--reset-limit": ["--reset-limit", "3"],
    "--blacklist-cooldown-range": ["--blacklist-cooldown-range", "10", "100"],
    "-p": ["-p", "2222"], "--ssh-port": ["--ssh-port", "2222"],
    "-i": ["-i", "{key}"], "--ssh-identity-file": ["--ssh-identity-file", "{key}"],
    "--network-interface": ["--network-interface", "lo"],
    "--output-filename": ["--output-filename", "{tmp}/logs"],
    "--verbose": ["--verbose"], "-v": ["-v"], "--log-level": ["--log-level", "DEBUG"],
    "--hostfile": ["--hostfile", "{hostfile}"], "-hostfile": ["-hostfile", "{hostfile}"],
    "--start-timeout": ["--start-timeout", "60"],
    "--fusion-threshold-mb": ["--fusion-threshold-mb", "32"],
    "--config-file": ["--config-file", "{config}"],
    "--no-stall-check": ["--no-stall-check"],
    "--stall-check-warning-time-seconds": ["--stall-check-warning-time-seconds", "30"],
    "--stall-check-shutdown-time-seconds": ["--stall-check-shutdown-time-seconds", "120"],
    "--log-hide-timestamp": ["--log-hide-timestamp"],
    "--prefix-output-with-timestamp": ["--prefix-output-with-timestamp"],
    **{flag: [flag] + (["1"] if nargs else [])
       for flag, (nargs, _) in horovod_flags.IGNORED_FLAGS.items()},
}


OURS_NAMED_THERE = {"--check-build", "--stall-timeout", "--timestamp-output"}


def test_every_horovodrun_flag_in_the_docs_has_a_case():
    named = _horovod_flags_in_docs()
    assert len(named) > 30, sorted(named)          # the paragraph was found
    missing = named - set(HOROVOD_FLAGS) - OURS_NAMED_THERE
    assert not missing, f"docs/horovod.md lists flags no test checks: {sorted(missing)}"


@pytest.mark.parametrize("flag", sorted(HOROVOD_FLAGS))
def test_horovodrun_flag_is_accepted(capsys, tmp_path, flag):
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    (tmp_path / "key").write_text("not a key\n")
    (tmp_path / "config.yaml").write_text("verbose: true\n")
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost\n")
    discover.chmod(0o755)
    given = [a.format(tmp=tmp_path, hostfile=tmp_path / "hosts", key=tmp_path / "key",
                      config=tmp_path / "config.yaml", discover=discover)
             for a in HOROVOD_FLAGS[flag]]
    np = [] if flag in ("-np", "--num-proc") else ["-np", "1"]
    out, err = plan(capsys, np + given)
    assert "first round:" in out
    warned = [line for line in err.splitlines() if "warning:" in line]
    assert len(warned) == (1 if flag in horovod_flags.IGNORED_FLAGS else 0), err


def test_stall_check_flags_map_onto_the_stall_timeout_and_its_warning():
    def timeout(*flags):
        return cli.config_from_args(cli.parse(["-np", "1", *flags, "true"])).stall_timeout

    assert timeout() == 600 and stalls.warn_after(timeout()) == stalls.WARN_AT_MOST_S
    assert timeout("--stall-check-shutdown-time-seconds", "90") == 90
    assert timeout("--stall-check-shutdown-time-seconds", "0") == horovod_flags.STALL_CHECK_OFF_S
    assert timeout("--no-stall-check") == horovod_flags.STALL_CHECK_OFF_S
    assert stalls.warn_after(timeout("--stall-check-warning-time-seconds", "5")) == 5
    # never later than the eviction itself
    assert stalls.warn_after(timeout("--stall-timeout", "3",
                                     "--stall-check-warning-time-seconds", "50")) == 3


# -- --config-file -------------------------------------------------------------------------------
def test_config_file_takes_horovodrun_keys_and_ours_and_the_command_line_wins(tmp_path, capsys):
    config = tmp_path / "elastic.yaml"
    config.write_text(
        "params:\n  fusion_threshold_mb: 8\n  cycle_time_ms: 5\n"
        "stall_check:\n  enabled: true\n  warning_time_seconds: 7\n  shutdown_time_seconds: 90\n"
        "logging:\n  level: debug\n"
        "min-np: 1\nmax_np: 3\nblacklist-cooldown-range: [10, 100]\nworker-timeout: 12\n")
    args = cli.parse(["--config-file", str(config), "-np", "2", "--worker-timeout", "20", "true"])
    job = cli.config_from_args(args)
    assert (job.np, job.min_np, job.max_np, job.cooldown_range) == (2, 1, 3, (10, 100))
    assert job.worker_timeout == 20                      # the command line wins
    assert job.stall_timeout == 90 and stalls.warn_after(job.stall_timeout) == 7
    assert job.extra_env[horovod_flags.FUSION_ENV] == str(8 * 2 ** 20)
    assert args.log_level == "DEBUG"
    assert horovod_flags.warnings_for(args, {}) == [
        f"warning: --cycle-time-ms ignored: {horovod_flags.IGNORED_FLAGS['--cycle-time-ms'][1]}"]


@pytest.mark.parametrize("text, words", [
    ("not_a_flag: 1\n", ["'not_a_flag'"]),
    ("params:\n  fusion_threshold: 8\n", ["params.fusion_threshold"]),
    ("verbose: maybe\n", ["verbose", "true or false"]),
    ("- a list\n", ["mapping"]),
    ("a: [unclosed\n", ["not YAML"]),
    ("max-np: 0\n", ["--max-np"]),
], ids=["unknown_key", "unknown_horovod_key", "switch_not_bool", "not_a_mapping",
        "not_yaml", "bad_value"])
def test_a_bad_config_file_is_one_error_line(tmp_path, capsys, text, words):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    code, out, err = run(capsys, ["--config-file", str(config), "-np", "1", "--dry-run", "true"])
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith("elasticrun: error:"), err
    for word in words:
        assert word in err, err


def test_a_missing_config_file_is_one_error_line(tmp_path, capsys):
    code, _, err = run(capsys, ["--config-file", str(tmp_path / "none.yaml"), "-np", "1", "true"])
    assert code == 2 and "none.yaml" in err and err.count("\n") == 1


def test_driver_lines_carry_a_timestamp_unless_hidden():
    shown = cli.log_format(cli.parse(["-np", "1", "true"]))
    hidden = cli.log_format(cli.parse(["-np", "1", "--log-hide-timestamp", "true"]))
    assert "%(asctime)s" in shown and "%(asctime)s" not in hidden
    assert shown.startswith("elasticrun: ") and hidden == "elasticrun: %(message)s"


@pytest.mark.parametrize("text, ranks", [("0", {0}), ("0,2-3", {0, 2, 3}), (" 1 , 4-4", {1, 4})])
def test_output_ranks(text, ranks):
    assert cli.output_ranks(text) == ranks


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0,,1"])
def test_bad_output_ranks_are_one_error_line(capsys, text):
    code, _, err = run(capsys, ["-np", "1", "--output-ranks", text, "--dry-run", "true"])
    assert code == 2 and err.startswith("elasticrun: error: --output-ranks") and \
        err.count("\n") == 1, err


def test_the_stall_warning_time_decides_when_the_rule_warns():
    now = 1000.0

    def views():
        stuck = stalls.StallView("3", stalls.Liveness(beat=1, beat_at=now, progress=(1, 1),
                                                      progress_at=now - 3), {5})
        peer = stalls.StallView("0", stalls.Liveness(
            beat=1, beat_at=now, progress=(1, 1), progress_at=now,
            waiting={"what": "allreduce", "round": 5, "seconds": 3, "on_peers": True}), {5})
        return [stuck, peer]

    assert stalls.find_stalls(views(), stall_timeout=100, now=now) == []     # warns at 50 s
    args = cli.parse(["-np", "1", "--stall-timeout", "100",
                      "--stall-check-warning-time-seconds", "2", "true"])
    found = stalls.find_stalls(views(), cli.config_from_args(args).stall_timeout, now=now)
    assert [(s.worker_id, s.action) for s in found] == [("3", "warn")]


# -- one check of the options for the command line, elastic.launch and the Ray executor ----
@pytest.mark.parametrize("flags, error", [
    (["-np", "2", "--min-np", "3"], "-np 2 is smaller than --min-np 3"),
    (["-np", "1", "--discovery-interval", "0"], "--discovery-interval must be a positive"),
    (["-np", "1", "--blacklist-cooldown-range", "5", "1"],
     "--blacklist-cooldown-range needs 0 <= MIN <= MAX"),
    (["-np", "1", "--port", "7"], "--port, --secret-file and --state-dir go with --serve"),
])
def test_the_command_line_and_launch_refuse_the_same_options_with_the_same_line(flags, error):
    from elastic.launching.client import validate_flags
    from elastic.runner.job_config import JobConfig
    from elastic.usage import UsageError
    with pytest.raises(UsageError, match=re.escape(error)):
        JobConfig.from_options(vars(cli.parse([*flags, "true"])))
    with pytest.raises(ValueError, match="^elasticrun: " + re.escape(error)):
        validate_flags(flags)


def test_job_config_from_options_gives_the_driver_its_limits():
    from elastic.runner.job_config import JobConfig
    config = JobConfig.from_options(vars(cli.parse(
        ["-np", "2", "--max-np", "5", "--reset-limit", "3", "--stall-timeout", "40", "true"])))
    limits = config.limits()
    assert (limits.np, limits.min_np, limits.max_np, limits.reset_limit) == (2, 2, 5, 3)
    assert limits.stall_timeout == 40 and limits.worker_timeout == config.worker_timeout
    assert config.command == ["true"] and config.discovery.discover() == {"localhost": 2}
