"""horovodrun's flags and HOROVOD_* variables that elasticrun takes for compatibility.

Some map onto ours (``--hostfile``, ``--start-timeout``, the fusion threshold as
DistributedOptimizer's bucket size, the stall check as ``--stall-timeout`` and
its warning, ``--check-build``). The rest mean nothing here: each one given
prints one warning line and the job goes on, so scripts written for horovodrun
start unchanged.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

from elastic.runner.discovery import DiscoveryError, parse_host_list
from elastic.runner.stalls import StallTimeout

STALL_CHECK_OFF_S = 7 * 24 * 3600.0     # --no-stall-check: no eviction for a stall this week

# flag -> (argparse nargs: 0 for a switch, 1 for a value; why it means nothing here)
IGNORED_FLAGS = {
    "--gloo": (0, "the data plane is always torch.distributed (gloo on CPU, NCCL on GPU)"),
    "--mpi": (0, "there is no MPI controller; workers are started by elasticrun"),
    "--jsm": (0, "there is no jsrun launcher; workers are started by elasticrun"),
    "--mpi-args": (1, "there is no MPI controller"),
    "--tcp": (0, "the data plane is torch.distributed's"),
    "--disable-cache": (0, "elasticrun keeps no cache of host checks"),
    "--timeline-filename": (1, "there is no Horovod timeline; use --event-log"),
    "--timeline-mark-cycles": (0, "there is no Horovod timeline; use --event-log"),
    "--autotune": (0, "there is no autotuner; buckets are sized by bucket_cap_mb"),
    "--autotune-log-file": (1, "there is no autotuner"),
    "--autotune-warmup-samples": (1, "there is no autotuner"),
    "--autotune-steps-per-sample": (1, "there is no autotuner"),
    "--autotune-bayes-opt-max-samples": (1, "there is no autotuner"),
    "--autotune-gaussian-process-noise": (1, "there is no autotuner"),
    "--cycle-time-ms": (1, "there is no background cycle: buckets launch when their "
                           "gradients are ready"),
    "--cache-capacity": (1, "there is no response cache: collectives run in program order"),
    "--hierarchical-allreduce": (0, "allreduce is torch.distributed's"),
    "--no-hierarchical-allreduce": (0, "allreduce is torch.distributed's"),
    "--hierarchical-allgather": (0, "allgather is torch.distributed's"),
    "--no-hierarchical-allgather": (0, "allgather is torch.distributed's"),
    "--num-nccl-streams": (1, "NCCL is torch.distributed's"),
    "--gloo-timeout-seconds": (1, "collectives wait in slices bounded by the round; "
                                  "see --stall-timeout"),
    "--mpi-threads-disable": (0, "there is no MPI"),
    "--ccl-bgt-affinity": (1, "there is no oneCCL"),
}

IGNORED_ENV = {
    "HOROVOD_CYCLE_TIME": "--cycle-time-ms",
    "HOROVOD_CACHE_CAPACITY": "--cache-capacity",
    "HOROVOD_AUTOTUNE": "--autotune",
    "HOROVOD_AUTOTUNE_LOG": "--autotune-log-file",
    "HOROVOD_TIMELINE": "--timeline-filename",
    "HOROVOD_TIMELINE_MARK_CYCLES": "--timeline-mark-cycles",
    "HOROVOD_HIERARCHICAL_ALLREDUCE": "--hierarchical-allreduce",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "--hierarchical-allgather",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "--gloo-timeout-seconds",
    "HOROVOD_NUM_NCCL_STREAMS": "--num-nccl-streams",
    "HOROVOD_CPU_OPERATIONS": "--gloo",
    "HOROVOD_CONTROLLER": "--gloo",
    "HOROVOD_MPI_THREADS_DISABLE": "--mpi-threads-disable",
}

FUSION_ENV = "HOROVOD_FUSION_THRESHOLD"   # bytes; read by elastic/training/optimizer_checks.py
START_TIMEOUT_ENV = "HOROVOD_START_TIMEOUT"


def add_to(parser: argparse.ArgumentParser) -> None:
    """Add --hostfile, --start-timeout, --fusion-threshold-mb and the ignored flags."""
    parser.add_argument("--hostfile", "-hostfile", dest="hostfile", metavar="FILE",
                        help="hosts file as horovodrun reads it: one 'host slots=N' (or "
                             "'host:N', or 'host') per line; # comments")
    parser.add_argument("--start-timeout", type=float, default=None, metavar="S",
                        help="evict a worker that has not reached elastic.init() after S "
                             "seconds (default: $HOROVOD_START_TIMEOUT, else max(120, "
                             "4 x --worker-timeout))")
    parser.add_argument("--fusion-threshold-mb", type=float, default=None, metavar="MB",
                        help="DistributedOptimizer's default bucket size (sets "
                             "HOROVOD_FUSION_THRESHOLD for the workers)")
    parser.add_argument("--check-build", action="store_true",
                        help="print what this installation supports (frameworks, "
                             "controllers, tensor operations) and exit")
    parser.add_argument("--stall-check-shutdown-time-seconds", type=float, default=None,
                        metavar="S", help="horovodrun's name for --stall-timeout S "
                                          "(0: no eviction for a stall)")
    parser.add_argument("--stall-check-warning-time-seconds", type=float, default=None,
                        metavar="S", help="warn about a stalled rank after S seconds "
                                          "(default: half --stall-timeout, at most 60)")
    parser.add_argument("--no-stall-check", action="store_true",
                        help="never evict a rank for a stall (as horovodrun's); the "
                             "warning stays")
    group = parser.add_argument_group("horovodrun flags that mean nothing here (a warning each)")
    for flag, (nargs, _why) in IGNORED_FLAGS.items():
        dest = "hvd_ignored_" + flag.lstrip("-").replace("-", "_")
        if nargs:
            group.add_argument(flag, dest=dest, default=None, metavar="X", help="ignored")
        else:
            group.add_argument(flag, dest=dest, action="store_true", default=None,
                               help="ignored")


def warnings_for(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """One line per ignored flag given and per meaningless HOROVOD_* variable set."""
    lines = []
    for flag, (_nargs, why) in IGNORED_FLAGS.items():
        value = getattr(args, "hvd_ignored_" + flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            lines.append(f"warning: {flag} ignored: {why}")
    for name, flag in IGNORED_ENV.items():
        if environ.get(name, "") != "":
            lines.append(f"warning: {name} ignored: {IGNORED_FLAGS[flag][1]}")
    return lines


def read_hostfile(path: str) -> dict[str, int]:
    """``{host: slots}`` from a horovodrun hosts file; DiscoveryError says what is wrong."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise DiscoveryError(f"--hostfile {path!r}: {exc.strerror}") from None
    entries = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *rest = line.split()
        if rest:
            if len(rest) != 1 or not rest[0].startswith("slots="):
                raise DiscoveryError(f"--hostfile {path}:{number}: expected 'host slots=N', "
                                     f"got {raw.strip()!r}")
            slots = rest[0][len("slots="):]
            if not slots.isdigit() or int(slots) < 1:
                raise DiscoveryError(f"--hostfile {path}:{number}: slots must be a positive "
                                     f"integer, got {slots!r}")
            host = f"{host}:{slots}"
        entries.append(host)
    if not entries:
        raise DiscoveryError(f"--hostfile {path}: no hosts in it")
    try:
        return parse_host_list(",".join(entries))
    except DiscoveryError as exc:
        raise DiscoveryError(f"--hostfile {path}: {str(exc).replace('-H: ', '')}") from None


def start_timeout(args: argparse.Namespace, environ: Mapping[str, str]) -> float | None:
    """--start-timeout, else $HOROVOD_START_TIMEOUT, else None (the driver's default)."""
    value = args.start_timeout
    if value is None and environ.get(START_TIMEOUT_ENV, "") != "":
        try:
            value = float(environ[START_TIMEOUT_ENV])
        except ValueError:
            raise ValueError(f"{START_TIMEOUT_ENV}={environ[START_TIMEOUT_ENV]!r} is not a "
                             "number of seconds") from None
    if value is not None and not (value > 0 and value != float("inf")):
        raise ValueError(f"--start-timeout must be a positive number, got {value}")
    return value


def stall_timeout(args: argparse.Namespace) -> StallTimeout:
    """--stall-timeout as horovodrun's stall-check flags adjust it (a StallTimeout)."""
    seconds = args.stall_timeout
    shutdown = args.stall_check_shutdown_time_seconds
    warn = args.stall_check_warning_time_seconds
    for name, value in (("--stall-check-shutdown-time-seconds", shutdown),
                        ("--stall-check-warning-time-seconds", warn)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be 0 or more, got {value}")
    if shutdown is not None:
        seconds = shutdown if shutdown > 0 else STALL_CHECK_OFF_S
    if args.no_stall_check:
        seconds = STALL_CHECK_OFF_S
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--stall-timeout must be a positive number, got {seconds}")
    return StallTimeout(seconds, warn if warn else None)


def check_build() -> list[str]:
    """The lines ``--check-build`` prints: what this installation can run."""
    import torch
    import torch.distributed as dist

    from elastic import __version__

    def box(flag: bool) -> str:
        return "[X]" if flag else "[ ]"

    nccl = torch.cuda.is_available() and dist.is_nccl_available()
    return [f"elastic {__version__} (torch {torch.__version__})",
            "Available frameworks:", f"    {box(True)} PyTorch",
            "Available controllers:", f"    {box(True)} torch.distributed TCPStore (gloo)",
            f"    {box(False)} MPI",
            "Available tensor operations:", f"    {box(nccl)} NCCL",
            f"    {box(dist.is_gloo_available())} Gloo", f"    {box(False)} MPI",
            f"    {box(False)} DDL", f"    {box(False)} CCL"]


def fusion_env(args: argparse.Namespace) -> dict[str, str]:
    """The workers' HOROVOD_FUSION_THRESHOLD (bytes) for --fusion-threshold-mb, or {}."""
    if args.fusion_threshold_mb is None:
        return {}
    if not args.fusion_threshold_mb >= 0:
        raise ValueError(f"--fusion-threshold-mb must be 0 or more, got "
                         f"{args.fusion_threshold_mb}")
    return {FUSION_ENV: str(int(args.fusion_threshold_mb * 2 ** 20))}
