"""The job's configuration (JobConfig), built and checked in one place for every way
a job starts: the command line (cli.py), ``elastic.launch`` and the Ray executor."""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic import protocol
from elastic.checkpoint import resume
from elastic.runner import horovod_flags, launcher, serve, stragglers
from elastic.runner.decisions import Limits
from elastic.runner.discovery import DiscoveryError, FixedDiscovery, ScriptDiscovery, parse_host_list
from elastic.runner.interfaces import DiscoverySource, LauncherBackend
from elastic.runner.stragglers import StragglerRule
from elastic.usage import UsageError


@dataclass
class JobConfig:
    """Everything one elasticrun job is run with. ``from_options`` builds it from the
    options by name, checked: the command line, ``elastic.launch`` and the Ray
    executor all go through it. The driver reads it as it is (``limits()`` for the
    decisions)."""

    command: list[str]
    discovery: DiscoverySource
    np: int = 1
    min_np: int = 1
    max_np: int | None = None
    discovery_interval: float = 1.0
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    repeat_limit: int = Limits.repeat_limit   # failed rounds with the same members, then decide
    cooldown_range: tuple[float, float] | None = None
    output_dir: str | None = None
    event_log: str | None = None
    worker_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    extra_env: dict[str, str] = field(default_factory=dict)
    ssh_port: int | None = None           # hosts that are not local are reached with ssh
    ssh_identity_file: str | None = None
    ssh_options: list[str] = field(default_factory=list)   # "Key=Value" for ssh -o
    remote_python: str = "python3"        # runs elastic/runner/remote.py on remote hosts
    network_interface: str | None = None  # store address for remote workers; gloo/NCCL iface
    port: int = 0                         # the store's port (0: any free one)
    secret: str | None = None             # the job secret (None: a fresh one for this job)
    backend: LauncherBackend | None = None   # launches on the hosts it owns (joining agents)
    start_timeout: float | None = None    # evict a worker not at elastic.init() by then
    stop_timeout: float = 20.0            # after SIGTERM/SIGINT: time to reach a commit and leave
    stall_timeout: float = 600.0          # evict a rank its peers waited on this long
                                          # (stalls.StallTimeout: with its warning's time)
    preempted_hold: float = 60.0          # a preempted host that discovery keeps listing returns
    console: Any = None                   # console.Console (cli builds it from the output flags)
    state_dir: str | None = None          # --serve --state-dir: what a restarted driver takes back
    metrics_port: int | None = None       # serve Prometheus metrics here (runner/metrics.py)
    tensorboard: str | None = None        # write TensorBoard scalars in this directory
    stragglers: StragglerRule | None = None   # None: StragglerRule's defaults
    start_warning: str | None = None      # printed once, after the first round's line
    warm_spare: bool = False              # a started python per local host (runner/spares.py)

    def limits(self) -> Limits:
        """The part of the configuration that the decisions depend on."""
        return Limits(np=self.np, min_np=self.min_np, max_np=self.max_np,
                      elastic_timeout=self.elastic_timeout, reset_limit=self.reset_limit,
                      worker_timeout=self.worker_timeout, start_timeout=self.start_timeout,
                      repeat_limit=self.repeat_limit,
                      stop_timeout=self.stop_timeout, stall_timeout=self.stall_timeout,
                      preempted_hold=self.preempted_hold, stragglers=self.stragglers)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> JobConfig:
        """The job that ``options`` describe (elasticrun's flags by their parsed names,
        as ``cli.parse`` gives them, ``command`` included), checked: UsageError (one
        line) for anything elasticrun would refuse."""
        args = argparse.Namespace(**options)
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        serving = None
        if args.serve and getattr(args, "warm_spare", False):
            raise UsageError("--warm-spare goes on the hosts that start workers: with --join "
                             "(each agent keeps one), not --serve")
        if args.serve:
            try:
                serving = serve.serve_settings(args, command)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        else:
            if args.port is not None or args.secret_file or args.state_dir:
                raise UsageError("--port, --secret-file and --state-dir go with --serve or --join")
            check_command(command)
        if args.np is None and args.min_np is None:
            raise UsageError("give -np (or --min-np)")
        np = args.np if args.np is not None else args.min_np
        min_np = args.min_np if args.min_np is not None else np
        for name, value in (("-np", np), ("--min-np", min_np), ("--max-np", args.max_np)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if args.max_np is not None and np > args.max_np:
            raise UsageError(f"-np {np} is larger than --max-np {args.max_np}")
        if args.max_np is not None and min_np > args.max_np:
            raise UsageError(f"--min-np {min_np} is larger than --max-np {args.max_np}")
        if np < min_np:
            raise UsageError(f"-np {np} is smaller than --min-np {min_np}")
        for name in ("discovery_interval", "discovery_timeout", "elastic_timeout", "worker_timeout",
                     "join_timeout", "stop_timeout"):
            value = getattr(args, name)
            if not (math.isfinite(value) and value > 0):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if args.reset_limit is not None and args.reset_limit < 0:
            raise UsageError("--reset-limit must be 0 or more")
        if args.repeat_limit < 1:
            raise UsageError(f"--repeat-limit must be at least 1, got {args.repeat_limit}")
        if args.slots is not None and args.slots < 1:
            raise UsageError("--slots-per-host must be at least 1")
        cooldown = None
        if args.blacklist_cooldown_range:
            lo, hi = args.blacklist_cooldown_range
            if not (math.isfinite(lo) and math.isfinite(hi)) or lo < 0 or hi < lo:
                raise UsageError("--blacklist-cooldown-range needs 0 <= MIN <= MAX")
            cooldown = (lo, hi)
        if sum(1 for given in (args.hosts, args.discovery_script, args.hostfile) if given) > 1:
            raise UsageError("give only one of -H, --hostfile and --host-discovery-script")
        try:
            start_timeout = horovod_flags.start_timeout(args, os.environ)
            straggler_rule = stragglers.rule(args.straggler_ratio, args.straggler_window,
                                             args.evict_stragglers)
            extra_env = horovod_flags.fusion_env(args)
            stall_timeout = horovod_flags.stall_timeout(args)
            output_ranks(args.output_ranks)
            if os.environ.get(protocol.ENV_CHECKPOINT_UNUSABLE):    # the workers inherit it
                resume.choice(os.environ[protocol.ENV_CHECKPOINT_UNUSABLE])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        discovery: DiscoverySource
        try:
            if serving is not None:
                discovery = serving[0]
            elif args.hostfile:
                discovery = FixedDiscovery(horovod_flags.read_hostfile(args.hostfile))
            elif args.discovery_script:
                discovery = ScriptDiscovery(args.discovery_script, args.slots, args.discovery_timeout)
                discovery.validate()
            else:
                hosts = args.hosts if args.hosts is not None else f"localhost:{np}"
                discovery = FixedDiscovery(parse_host_list(hosts))
        except DiscoveryError as exc:
            raise UsageError(str(exc)) from None
        if args.output_dir:
            try:
                os.makedirs(args.output_dir, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--output-filename {args.output_dir!r}: {exc.strerror}") from None
        try:
            ssh_options = [launcher.check_ssh_option(o) for o in args.ssh_options]
            if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
                raise ValueError(f"--ssh-port {args.ssh_port} is not a port number")
            if args.ssh_identity_file and not os.path.isfile(
                    os.path.expanduser(args.ssh_identity_file)):
                raise ValueError(f"--ssh-identity-file {args.ssh_identity_file!r} does not exist")
            if not args.remote_python.strip():
                raise ValueError("--remote-python must not be empty")
            if args.network_interface:
                launcher.interface_ipv4(args.network_interface)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except OSError as exc:
            raise UsageError(f"--network-interface {exc}") from None
        if args.event_log:
            try:
                open(args.event_log, "a").close()
            except OSError as exc:
                raise UsageError(f"--event-log {args.event_log!r}: {exc.strerror}") from None
        if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
            raise UsageError(f"--metrics-port {args.metrics_port} is not a port number")
        if args.tensorboard:
            try:
                os.makedirs(args.tensorboard, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--tensorboard {args.tensorboard!r}: {exc.strerror}") from None
        served: dict[str, Any] = ({"backend": serving[0], "secret": serving[1],
                                   "port": serving[2]} if serving else {})
        return cls(
            command=command, metrics_port=args.metrics_port, tensorboard=args.tensorboard,
            discovery=discovery, np=np, min_np=min_np, max_np=args.max_np,
            discovery_interval=args.discovery_interval, elastic_timeout=args.elastic_timeout,
            reset_limit=args.reset_limit, repeat_limit=args.repeat_limit, cooldown_range=cooldown,
            output_dir=args.output_dir,
            worker_timeout=args.worker_timeout, event_log=args.event_log, ssh_port=args.ssh_port,
            stop_timeout=args.stop_timeout, stall_timeout=stall_timeout,
            ssh_identity_file=args.ssh_identity_file, ssh_options=ssh_options,
            remote_python=args.remote_python, network_interface=args.network_interface,
            extra_env={**extra_env, **({protocol.ENV_CHECKPOINT_DIR: os.path.abspath(
                args.checkpoint_dir)} if args.checkpoint_dir else {}),
                **({protocol.ENV_CHECKPOINT_UNUSABLE: args.on_unusable_checkpoint}
                   if args.on_unusable_checkpoint else {})},
            start_timeout=start_timeout, stragglers=straggler_rule, state_dir=args.state_dir,
            warm_spare=bool(getattr(args, "warm_spare", False)),
            **served,
        )


def check_command(command: Sequence[str]) -> None:
    """The training command exists and can run (UsageError if not)."""
    if not command:
        raise UsageError("no training command given")
    exe = command[0]
    if os.sep in exe:
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise UsageError(f"training command {exe!r} does not exist or is not executable")
    elif shutil.which(exe) is None:
        raise UsageError(f"training command {exe!r} not found on PATH")


def output_ranks(text: str | None) -> set[int] | None:
    """``--output-ranks 0,2-3`` as a set of ranks (None when not given)."""
    if text is None:
        return None
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError
            ranks.update(range(first, last + 1))
    except ValueError:
        raise UsageError(f"--output-ranks {text!r}: expected ranks such as 0 or 0,2-3") \
            from None
    return ranks
