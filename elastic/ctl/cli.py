"""``elasticctl``: status, top, drain, stop and resize for a running elasticrun job.

A separate command, so that ``elasticrun status`` keeps meaning "run a program
called status". Bad input and an unreachable job end with one line on stderr
(exit 2 for usage, 1 otherwise), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TextIO

from elastic.ctl.client import Client, CtlError, find_target
from elastic.ctl.render import render
from elastic.usage import Parser, UsageError

CLEAR = "\x1b[H\x1b[2J"      # cursor home, clear screen


def build_parser() -> Parser:
    p = Parser(prog="elasticctl", description="Look at and steer a running elasticrun job.")
    p.add_argument("--job", type=int, metavar="PID",
                   help="the job whose driver has this pid (when several run here)")
    p.add_argument("--addr", metavar="HOST:PORT",
                   help="a job on another machine: its control store's address (elasticrun "
                        "logs it); needs --secret-file")
    p.add_argument("--secret-file", metavar="FILE", help="with --addr: the job secret")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the driver's answer (default 10)")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)
    status = sub.add_parser("status", help="print the job's status once")
    status.add_argument("--json", action="store_true", help="as JSON")
    status.add_argument("--watch", action="store_true", help="refresh it, as top does")
    status.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    top = sub.add_parser("top", help="the status, refreshed every --interval seconds")
    top.add_argument("--interval", type=float, default=1.0,
                     help="seconds between refreshes (default 1)")
    drain = sub.add_parser("drain", help="take HOST out: its workers leave at the next commit")
    drain.add_argument("host", metavar="HOST")
    sub.add_parser("stop", help="stop the job as SIGTERM to elasticrun does")
    resize = sub.add_parser("resize", help="change the job's --max-np")
    resize.add_argument("--max-np", type=int, required=True, metavar="N")
    return p


def _top(client: Client, label: str, interval: float, out: TextIO) -> int:
    """Redraw until Ctrl-C (exit 0) or until the job ends (exit 0, with a last line)."""
    try:
        while True:
            try:
                status = client.request("status")["status"]
            except CtlError as exc:
                out.write(f"\n{exc}\n")
                return 0
            stamp = time.strftime("%H:%M:%S")
            out.write(f"{CLEAR}elasticctl top  {stamp}  (every {interval:g} s; Ctrl-C quits)\n"
                      f"{render(status, label)}\n")
            out.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        out.write("\n")
        return 0


def run(args: argparse.Namespace, out: TextIO) -> int:
    if args.cmd is None:
        raise UsageError("give a command: status, top, drain HOST, stop or resize --max-np N")
    if not args.timeout > 0:
        raise UsageError("--timeout must be a positive number")
    interval = getattr(args, "interval", 1.0)
    if not interval > 0:
        raise UsageError("--interval must be a positive number")
    if args.secret_file and not args.addr:
        raise UsageError("--secret-file goes with --addr HOST:PORT")
    target = find_target(job=args.job, addr=args.addr, secret_file=args.secret_file)
    client = Client(target, timeout=args.timeout)
    if args.cmd == "top" or (args.cmd == "status" and args.watch):
        return _top(client, target.label, interval, out)
    if args.cmd == "status":
        status = client.request("status")["status"]
        out.write((json.dumps(status, indent=1, sort_keys=True) if args.json
                   else render(status, target.label)) + "\n")
        return 0
    if args.cmd == "drain":
        reply = client.request("drain", host=args.host)
    elif args.cmd == "stop":
        reply = client.request("stop")
    else:
        reply = client.request("resize", max_np=args.max_np)
    out.write(f"{reply.get('message', 'done')}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return run(args, sys.stdout)
    except UsageError as exc:
        sys.stderr.write(f"elasticctl: error: {exc}\n")
        return 2
    except CtlError as exc:
        sys.stderr.write(f"elasticctl: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
