"""``elasticrun``: parse and check the command line, then run the job.

Bad input ends with one line on stderr and exit code 2, never a traceback.
Everything from the training command on is the command's own: the command line
is split there before our flags are parsed, so ``python train.py --n 3`` never
reaches argparse (whose prefix matching would take ``--n`` for one of ours).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence

from elastic import __version__, protocol
from elastic.runner import config_file, dry_run, horovod_flags, repeats, serve
from elastic.runner.agent import DEFAULT_DRIVER_GRACE_S, run_agent
from elastic.runner.console import Console
from elastic.runner.discovery import DiscoveryError
from elastic.runner.driver import run_job
from elastic.runner.job_config import JobConfig, check_command, output_ranks
from elastic.usage import Parser, UsageError


def build_parser() -> Parser:
    p = Parser(prog="elasticrun", description="Run an elastic PyTorch data-parallel job.",
                usage="elasticrun [OPTIONS] COMMAND [ARGS ...]")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument("--config-file", metavar="FILE",
                   help="YAML file of settings: elasticrun's flags by long name and "
                        "horovodrun's config keys; the command line wins")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (hosts, slots, first round, where the control "
                        "store listens) and exit without starting anything")
    p.add_argument("-np", "--num-proc", dest="np", type=int,
                   help="start once this many slots are available")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                   help="fewest workers to train with (default: -np)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                   help="most workers (default: no limit)")
    p.add_argument("-H", "--hosts", dest="hosts", help="fixed host list host:slots,...")
    p.add_argument("--host-discovery-script", dest="discovery_script",
                   help="executable printing one host or host:slots per line")
    p.add_argument("--slots-per-host", "--slots", dest="slots", type=int,
                   help="slots for a discovered host given without :slots")
    p.add_argument("--discovery-interval", type=float, default=1.0,
                   help="seconds between discovery runs (default 1.0)")
    p.add_argument("--discovery-timeout", type=float, default=30.0,
                   help="longest a discovery run may take (default 30)")
    p.add_argument("--elastic-timeout", type=float, default=600.0,
                   help="longest wait for --min-np slots (default 600)")
    p.add_argument("--reset-limit", type=int, help="most membership changes before failing")
    p.add_argument("--repeat-limit", type=int, default=repeats.GROUP_REPEAT_LIMIT, metavar="N",
                   help="rounds that fail in a row with the same members (a group error) before "
                        "the driver blames the hosts that reported it every time, or stops the "
                        f"job when all did (default {repeats.GROUP_REPEAT_LIMIT})")
    p.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                   help="seconds before a blacklisted host may return")
    p.add_argument("--worker-timeout", type=float, default=30.0,
                   help="evict a worker silent for this many seconds (default 30)")
    p.add_argument("--stop-timeout", type=float, default=20.0,
                   help="after SIGTERM/SIGINT (to elasticrun or to one worker), seconds a "
                        "worker may take to reach its next commit and leave before it is "
                        "killed (default 20)")
    p.add_argument("--stall-timeout", type=float, default=600.0,
                   help="evict a rank that made no progress while its peers waited on it "
                        "in a collective this many seconds (default 600)")
    p.add_argument("--straggler-ratio", type=float, default=2.0, metavar="R",
                   help="warn about a worker whose work per commit is R times its peers' "
                        "median over --straggler-window (default 2; 0: never)")
    p.add_argument("--straggler-window", type=float, default=30.0, metavar="S",
                   help="seconds of timing that stragglers are judged on (default 30, at "
                        "most 60)")
    p.add_argument("--evict-stragglers", action="store_true",
                   help="evict a straggler (its host is blacklisted) instead of only warning")
    p.add_argument("--warm-spare", action="store_true",
                   help="keep one started python on this machine (with --join: on the agent's "
                        "host) that has imported torch, and make it the next worker started "
                        "there: a replacement after a crash skips the imports (needs a command "
                        "of the form PYTHON SCRIPT.py ...)")
    p.add_argument("--output-filename", dest="output_dir",
                   help="directory for per-worker stdout/stderr files (and error.json)")
    p.add_argument("--timestamp-output", "--prefix-output-with-timestamp",
                   dest="timestamp_output", action="store_true",
                   help="prefix each worker line on the console with the time it arrived")
    p.add_argument("--output-ranks", metavar="RANKS",
                   help="show only the console output of these ranks (e.g. 0 or 0,2-3) "
                        "in the current round; files keep everything")
    p.add_argument("-p", "--ssh-port", type=int,
                   help="ssh port of the hosts that are not local (default: ssh's own)")
    p.add_argument("-i", "--ssh-identity-file",
                   help="ssh private key for the hosts that are not local")
    p.add_argument("--ssh-option", dest="ssh_options", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="extra 'ssh -o KEY=VALUE' (repeatable), e.g. "
                        "UserKnownHostsFile=/path/known_hosts or StrictHostKeyChecking="
                        "accept-new. Host keys are checked as your ssh config says; "
                        "always set: BatchMode=yes ConnectTimeout=10 ServerAliveInterval=5 "
                        "ServerAliveCountMax=3 (yours take precedence)")
    p.add_argument("--remote-python", default="python3",
                   help="python on the remote hosts that runs the bootstrap "
                        "elastic/runner/remote.py from this same path (standard library "
                        "only; the package must sit at the same path there, e.g. a shared "
                        "filesystem). Default python3")
    p.add_argument("--network-interface", "--network-interfaces", metavar="IF",
                   help="remote workers reach the driver's store at this interface's IPv4 "
                        "address (default: the address this machine uses towards each "
                        "host); workers get GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME=IF")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="durable checkpoints for every worker's TorchState (sets "
                        "ELASTIC_CHECKPOINT_DIR): rerunning the same command resumes there")
    p.add_argument("--on-unusable-checkpoint", choices=("previous", "stop"), default=None,
                   help="when the newest checkpoint cannot be used (a newer format, objects "
                        "that no longer unpickle, another model): resume from the newest "
                        "that loads, with one warning (previous, the default), or stop with "
                        "one line (stop). Never starts from scratch while checkpoints exist")
    p.add_argument("--event-log", help="append JSON-lines events (rounds, failures, pauses, "
                   "progress) to this file; `python -m elastic.runner.timeline FILE` draws them")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics (0: any free "
                        "port, logged); needs prometheus_client")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="write world size, pauses and report_progress numbers as TensorBoard "
                        "scalars in DIR; needs tensorboard")
    p.add_argument("--serve", action="store_true",
                   help="run the driver only: admit the agents that join it "
                        "(elasticrun --join) instead of launching workers")
    p.add_argument("--port", type=int,
                   help="with --serve: the port agents and workers connect to (default: any)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="with --serve/--join: a file holding the job secret (text)")
    p.add_argument("--join", metavar="HOST:PORT",
                   help="run as an agent on this host: join the driver serving at HOST:PORT "
                        "and run its workers here (COMMAND is the training command)")
    p.add_argument("--host-name", metavar="NAME",
                   help="with --join: this host's name in the job (default: the hostname)")
    p.add_argument("--join-timeout", type=float, default=60.0,
                   help="with --join: how long to wait for the driver to listen (default 60)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="with --serve: keep what a restarted driver takes back here (blacklist, "
                        "reset count, rounds); put it on a volume that outlives the pod")
    p.add_argument("--driver-grace", type=float, default=DEFAULT_DRIVER_GRACE_S, metavar="S",
                   help="with --join: how long this host's workers train on while the driver "
                        "is gone, waiting for it to come back at the same address "
                        f"(default {DEFAULT_DRIVER_GRACE_S:g})")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--log-hide-timestamp", action="store_true",
                   help="driver lines without their timestamp")
    p.add_argument("--log-level", default=None,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    horovod_flags.add_to(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="training command")
    return p


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The job's settings from parsed arguments (JobConfig.from_options checks them)."""
    return JobConfig.from_options(vars(args))


def no_checkpoint_warning(job_env: Mapping[str, str], environ: Mapping[str, str],
                          serving: bool) -> str | None:
    """The one warning for a job without durable checkpoints (None when it has them)."""
    if job_env.get(protocol.ENV_CHECKPOINT_DIR) or environ.get(protocol.ENV_CHECKPOINT_DIR):
        return None
    return ("no --checkpoint-dir: progress lives only in the workers' memory; losing every "
            "worker" + ("" if serving else ", or this driver (outside joining mode),") +
            " loses it (docs/checkpoints.md)")


def split_command(parser: Parser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``(our flags, the training command)``: the command starts at the first word
    that is neither a flag of ours nor a flag's value, or after ``--``. A flag we
    do not know stays on our side, so argparse names it."""
    options = parser.flags
    longs = [o for o in options if o.startswith("--")]
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        name, has_value, _ = word.partition("=")
        flag = options.get(name)
        if flag is None and name.startswith("--"):
            matches = [o for o in longs if o.startswith(name)]
            flag = options[matches[0]] if len(matches) == 1 else None
        i += 1
        if flag is not None and not has_value:
            i += 1 if flag.nargs is None else flag.nargs
    return argv, []


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed arguments; ``args.command`` is the training command, untouched."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, command = split_command(parser, argv)
    args = parser.parse_args(ours)
    if args.config_file:
        try:
            from_file = config_file.to_argv(args.config_file, parser.flags)
        except config_file.ConfigFileError as exc:
            raise UsageError(str(exc)) from None
        args = parser.parse_args(from_file + ours)
    args.command = command
    return args


def log_format(args: argparse.Namespace) -> str:
    return "elasticrun: %(message)s" if args.log_hide_timestamp else \
        "elasticrun: %(asctime)s %(message)s"


def _agent_main(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        config = serve.agent_config(args, command)
        check_command(command)
    except (ValueError, UsageError) as exc:
        sys.stderr.write(f"elasticrun: error: {exc}\n")
        return 2
    level = "DEBUG" if args.verbose else (args.log_level or "INFO")
    logging.basicConfig(level=level, format=log_format(args), datefmt="%Y-%m-%d %H:%M:%S",
                        stream=sys.stderr)
    return run_agent(config)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
        if args.version:
            sys.stdout.write(f"elasticrun {__version__}\n")
            return 0
        if args.check_build:
            sys.stdout.write("".join(line + "\n" for line in horovod_flags.check_build()))
            return 0
        if args.join:
            return _agent_main(args)
        config = config_from_args(args)
        for line in horovod_flags.warnings_for(args, os.environ):
            sys.stderr.write(f"elasticrun: {line}\n")
        if args.dry_run:
            sys.stdout.write("".join(line + "\n" for line in dry_run.plan_lines(config)))
            return 0
    except (UsageError, DiscoveryError) as exc:
        sys.stderr.write(f"elasticrun: error: {exc}\n")
        return 2
    level = "DEBUG" if args.verbose else (args.log_level or "INFO")
    logging.basicConfig(level=level, format=log_format(args), datefmt="%Y-%m-%d %H:%M:%S",
                        stream=sys.stderr)
    # Workers' uncaught exceptions land in error files: kept under --output-filename,
    # else in a private directory that goes when the job does.
    error_dir = args.output_dir or tempfile.mkdtemp(prefix="elasticrun-errors-")
    config.extra_env[protocol.ENV_ERROR_DIR] = os.path.abspath(error_dir)
    config.console = Console(config.output_dir, timestamps=args.timestamp_output,
                             ranks=output_ranks(args.output_ranks),
                             error_dir=config.extra_env[protocol.ENV_ERROR_DIR],
                             keep_error_files=bool(args.output_dir))
    config.start_warning = no_checkpoint_warning(config.extra_env, os.environ, serving=args.serve)
    try:
        return run_job(config)
    finally:
        if not args.output_dir:
            shutil.rmtree(error_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
