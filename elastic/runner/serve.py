"""Command-line checks for ``elasticrun --serve`` and ``elasticrun --join``.

Each function turns parsed flags into what the driver or the agent needs, or
raises ValueError with the one line the user sees.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import socket
from collections.abc import Sequence

from elastic.auth import weak_secret
from elastic.runner.agent import AgentConfig, AgentFailed, read_secret_file
from elastic.runner.agents import AgentHub
from elastic.runner.discovery import DiscoveryError, parse_host_list

SERVE_ONLY = ("hosts", "discovery_script")


def read_secret(path: str | None) -> str:
    """The job secret as text (both sides sign with its UTF-8 bytes)."""
    if not path:
        raise ValueError("--serve and --join need --secret-file FILE (the job secret)")
    try:
        secret = read_secret_file(path)
    except AgentFailed as exc:
        raise ValueError(str(exc)) from None
    problem = weak_secret(secret)
    if problem:
        raise ValueError(f"--secret-file {path!r} {problem}")
    try:
        return secret.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--secret-file {path!r} must hold text (e.g. openssl rand "
                         "-hex 32)") from None


def check_port(port: int | None, flag: str = "--port") -> int:
    if port is None or not 0 <= port < 65536:
        raise ValueError(f"{flag} {port} is not a port number")
    return port


def serve_settings(args: argparse.Namespace, command: Sequence[str],
                   ) -> tuple[AgentHub, str, int]:
    """(hub, secret, port) for a driver that admits joining agents."""
    if args.hosts or args.discovery_script:
        raise ValueError("--serve takes its hosts from the agents that join it; "
                         "drop -H / --host-discovery-script")
    if command:
        raise ValueError("with --serve the training command goes to each "
                         "`elasticrun --join HOST:PORT ... COMMAND`, not to the driver")
    if args.slots is not None:
        raise ValueError("--slots is given per agent (elasticrun --join --slots N)")
    secret = read_secret(args.secret_file)
    port = check_port(args.port if args.port is not None else 0)
    return AgentHub(timeout_s=args.worker_timeout), secret, port


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--join {text!r} is not HOST:PORT")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"--join {text!r}: bad IPv6 address") from None
    return host, check_port(int(port), "--join port")


def agent_config(args: argparse.Namespace, command: list[str]) -> AgentConfig:
    """AgentConfig for ``elasticrun --join HOST:PORT ... COMMAND``."""
    if args.serve:
        raise ValueError("give either --serve (the driver) or --join (an agent), not both")
    if not command:
        raise ValueError("--join needs the training command to run on this host")
    host, port = parse_address(args.join)
    read_secret(args.secret_file)
    name = args.host_name or socket.gethostname()
    try:
        parse_host_list(name)
    except DiscoveryError as exc:
        raise ValueError(f"--host-name: {str(exc).replace('-H: ', '')}") from None
    if "," in name or ":" in name:
        raise ValueError(f"--host-name {name!r} must be a plain host name")
    for flag, value in (("--join-timeout", args.join_timeout),
                        ("--stop-timeout", args.stop_timeout),
                        ("--driver-grace", args.driver_grace)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive number, got {value}")
    slots = args.slots if args.slots is not None else 1
    if slots < 1:
        raise ValueError("--slots must be at least 1")
    return AgentConfig(driver_host=host, driver_port=port, secret_file=args.secret_file,
                       command=command, host_name=name, slots=slots,
                       connect_timeout=args.join_timeout, stop_timeout=args.stop_timeout,
                       output_dir=args.output_dir, driver_grace=args.driver_grace,
                       warm_spare=bool(getattr(args, "warm_spare", False)))
