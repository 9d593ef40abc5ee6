"""``elastic.launch``: run a Python function as an elastic job, get each rank's result.

The function travels to the workers with cloudpickle, in a file only this user
can read. ``elasticrun`` runs as a child process (``python -m elastic.runner``),
so the caller's process keeps its own signal handlers and works the same from a
script, a test or a notebook. Each worker of the final round pickles what the
function returned; ``launch`` gathers those in rank order.

Files live in a private temporary directory (``workdir``, or the system's temp
directory). Workers on other hosts read and write it at the same path, so for a
multi-host job put ``workdir`` on a filesystem they share.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable, NoReturn, Union

import cloudpickle

from elastic.exceptions import ElasticError
from elastic.launching.worker import ERRORS
from elastic.streams import pump_output, read_json_lines

RESULTS = "results"
STDERR_TAIL_LINES = 20
_OUTPUT_TAIL_LINES = 200
_TERMINATE_GRACE_S = 30.0     # elasticrun stops at the next commit: --stop-timeout 20 s
_WORKER_RE = re.compile(r"\bworker (\S+?)(?: on (\S+?))?(?=[\s;:,)]|$)")

PathArg = Union[str, "os.PathLike[str]"]      # a file name, as a string or a path object
HostsArg = Union[str, Iterable[str], Mapping[str, int]]   # "host:slots,...", entries, {host: slots}


class LaunchError(ElasticError):
    """The launched job failed; ``str()`` says which worker and why.

    Attributes (None when unknown): ``worker`` (worker id), ``host``, ``rank``,
    ``exit_code`` (elasticrun's), ``error_line`` (elasticrun's one-line error),
    ``exc_type`` and ``exc_message`` (what the function raised), ``remote_traceback``,
    ``stderr_tail`` (the last lines of that worker's stderr), ``failed_at`` (when it
    raised, as time.time()), ``root_cause`` (elasticrun's root-cause block, lines).
    """

    def __init__(self, message: str, *, worker: str | None = None, host: str | None = None,
                 rank: int | None = None, exit_code: int | None = None,
                 error_line: str | None = None, exc_type: str | None = None,
                 exc_message: str | None = None, remote_traceback: str | None = None,
                 stderr_tail: str | None = None, failed_at: float | None = None,
                 root_cause: list[str] | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.host = host
        self.rank = rank
        self.exit_code = exit_code
        self.error_line = error_line
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.stderr_tail = stderr_tail
        self.failed_at = failed_at
        self.root_cause = root_cause


def launch(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, np: int = 1,
           min_np: int | None = None, max_np: int | None = None,
           hosts: HostsArg | None = None, discovery_script: PathArg | None = None,
           env: dict | None = None, timeout: float | None = None, quiet: bool = False,
           workdir: str | None = None, **elasticrun_options: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on every worker of an elastic job.

    Returns the values ``fn`` returned on the workers of the final round, as a
    list ordered by rank. ``fn`` may call ``elastic.init()`` and use
    ``@elastic.run`` as any training script does; each worker's rank is read
    with ``elastic.rank()`` after ``fn`` returns.

    ``hosts``: ``"host:slots,..."`` (like ``-H``), a list of such entries or a
    ``{host: slots}`` dict; or ``discovery_script``: a path (like
    ``--host-discovery-script``). Neither: ``np`` slots on this machine.
    ``env``: extra environment variables for the job. ``timeout``: seconds
    before the job is stopped and ``LaunchError`` raised. ``quiet``: do not
    pass the job's output through to ``sys.stdout``/``sys.stderr``.
    ``workdir``: where the private temporary directory goes (shared filesystem
    for multi-host jobs). Other keyword arguments are elasticrun flags:
    ``elastic_timeout=60`` is ``--elastic-timeout 60``, ``verbose=True`` is
    ``--verbose``, ``blacklist_cooldown_range=(10, 100)``, ``ssh_option=[...]``.
    ``horovod.run``'s keywords work too (``num_proc``, ``min_num_proc``,
    ``max_num_proc``, ``host_discovery_script``, ``hostfile``, ``start_timeout``,
    ``cooldown_range``, ``slots``, ``use_gloo``, ``use_mpi``, ``disable_cache``,
    ...); as in Horovod, ``None`` and ``False`` mean "not given".

    Bad arguments raise ``ValueError``/``TypeError`` before anything starts; a
    failed job raises ``LaunchError`` naming the failing worker.
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if env is not None and not all(isinstance(k, str) and isinstance(v, str)
                                   for k, v in dict(env).items()):
        raise TypeError("env must map str to str")
    np, min_np, max_np, discovery_script, elasticrun_options = horovod_keywords(
        np, min_np, max_np, discovery_script, elasticrun_options)
    flags = elasticrun_flags(np, min_np, max_np, hosts, discovery_script, elasticrun_options)
    job_env = child_env(env)
    validate_flags(flags)
    try:
        payload = pickle.dumps({
            "sys_path": worker_sys_path(),
            "call": cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))),
        }, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - cloudpickle raises many kinds
        raise TypeError(f"cannot pickle the function or its arguments: "
                        f"{type(exc).__name__}: {exc}") from exc

    tmp = tempfile.mkdtemp(prefix="elastic-launch-", dir=workdir)   # mode 0700
    try:
        paths = prepare_workdir(tmp, payload)
        own_logs = "output_filename" not in elasticrun_options
        log_dir = os.path.join(tmp, "logs") if own_logs else elasticrun_options["output_filename"]
        event_log = elasticrun_options.get("event_log") or os.path.join(tmp, "events.jsonl")
        argv = [sys.executable, "-m", "elastic.runner"] + flags
        if own_logs:
            argv += ["--output-filename", log_dir]
        if "event_log" not in elasticrun_options:
            argv += ["--event-log", event_log]
        argv += ["--", sys.executable, "-m", "elastic.launching.worker",
                 paths["payload"], paths["results"]]
        code, driver_log = run_elasticrun(argv, job_env, timeout, quiet)
        job = Outcome(paths["results"], log_dir, event_log, driver_log)
        if code is None:
            raise job.error(f"timed out after {timeout:g} s; the job was stopped", None)
        return job.results(code)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- arguments ----------------------------------------------------------------------------

_HOROVOD_RENAMES = {"cooldown_range": "blacklist_cooldown_range", "use_gloo": "gloo",
                    "use_mpi": "mpi"}


def horovod_keywords(np: int, min_np: int | None, max_np: int | None,
                     discovery_script: PathArg | None, options: Mapping[str, Any],
                     ) -> tuple[int, int | None, int | None, PathArg | None, dict[str, Any]]:
    """horovod.run's spellings onto ours; None and False are dropped, as Horovod does."""
    options = dict(options)
    given = {}
    for theirs, ours in (("num_proc", "np"), ("min_num_proc", "min_np"),
                         ("max_num_proc", "max_np"), ("host_discovery_script", "discovery_script")):
        value = options.pop(theirs, None)
        if value is not None:
            given[ours] = value
    if "np" in given and np != 1 and np != given["np"]:
        raise TypeError("give np or num_proc, not both")
    np = given.get("np", np)
    for ours, current in (("min_np", min_np), ("max_np", max_np),
                          ("discovery_script", discovery_script)):
        if ours in given and current is not None:
            raise TypeError(f"give {ours} or its Horovod spelling, not both")
    min_np = given.get("min_np", min_np)
    max_np = given.get("max_np", max_np)
    discovery_script = given.get("discovery_script", discovery_script)
    for theirs, ours in _HOROVOD_RENAMES.items():
        if theirs in options:
            options[ours] = options.pop(theirs)
    if options.get("executable") is not None:
        raise ValueError("executable: workers run this interpreter (sys.executable)")
    options.pop("executable", None)
    if "verbose" in options and not isinstance(options["verbose"], bool):
        options["verbose"] = bool(options["verbose"])   # Horovod's verbose is a level
    return np, min_np, max_np, discovery_script, {
        k: v for k, v in options.items() if v is not None and v is not False}


def elasticrun_flags(np: int, min_np: int | None, max_np: int | None, hosts: HostsArg | None,
                     discovery_script: PathArg | None, options: Mapping[str, Any]) -> list[str]:
    for name, value in (("np", np), ("min_np", min_np), ("max_np", max_np)):
        if (value is not None or name == "np") and (
                isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if hosts is not None and discovery_script is not None:
        raise ValueError("give either hosts or discovery_script, not both")
    flags = ["-np", str(np)]
    if min_np is not None:
        flags += ["--min-np", str(min_np)]
    if max_np is not None:
        flags += ["--max-np", str(max_np)]
    if hosts is not None:
        flags += ["-H", _hosts_arg(hosts)]
    if discovery_script is not None:
        flags += ["--host-discovery-script", os.path.abspath(os.fspath(discovery_script))]
    from elastic.runner.cli import build_parser
    known = build_parser().flags
    for key, value in options.items():
        option = "--" + key.replace("_", "-")
        flag = known.get(option)
        if flag is None or key in ("num_proc", "min_num_proc", "max_num_proc", "hosts",
                                   "host_discovery_script", "help"):
            raise TypeError(f"launch() got an unexpected keyword argument {key!r}")
        if value is None or value is False:
            continue
        if flag.nargs == 0:                       # --verbose
            flags.append(option)
        elif flag.repeatable or flag.nargs is not None:
            values = [value] if isinstance(value, (str, int, float)) else list(value)
            if flag.nargs is not None:            # --blacklist-cooldown-range MIN MAX
                flags += [option] + [str(v) for v in values]
            else:                                 # repeatable, e.g. --ssh-option
                for v in values:
                    flags += [option, str(v)]
        else:
            flags += [option, str(os.fspath(value)) if isinstance(value, os.PathLike)
                      else str(value)]
    return flags


def _hosts_arg(hosts: HostsArg) -> str:
    if isinstance(hosts, str):
        return hosts
    if isinstance(hosts, dict):
        return ",".join(f"{h}:{s}" for h, s in hosts.items())
    try:
        return ",".join(str(h) for h in hosts)
    except TypeError:
        raise TypeError(f"hosts must be a string, list or dict, got {type(hosts).__name__}") \
            from None


def validate_flags(flags: Iterable[str]) -> None:
    """Check elasticrun's ``flags`` as elasticrun will (JobConfig.from_options, as the
    command line does), so bad ones fail with ValueError before anything starts."""
    from elastic.runner.cli import build_parser
    from elastic.runner.job_config import JobConfig
    from elastic.usage import UsageError
    command = [sys.executable, "-m", "elastic.launching.worker"]
    try:
        options = vars(build_parser().parse_args(list(flags)))
        JobConfig.from_options({**options, "command": command})
    except UsageError as exc:
        raise ValueError(f"elasticrun: {exc}") from None


def child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    # The job's processes must import this same elastic package.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([root] + parts)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def worker_sys_path() -> list[str]:
    """The caller's import path, so that functions pickled by reference (defined in
    a module of the caller's project) import on the workers too."""
    return [os.path.abspath(p or os.curdir) for p in sys.path]


def prepare_workdir(tmp: str, payload: bytes) -> dict[str, str]:
    path = os.path.join(tmp, "fn.pkl")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    results = os.path.join(tmp, RESULTS)
    os.mkdir(results, 0o700)
    os.mkdir(os.path.join(results, ERRORS), 0o700)
    return {"payload": path, "results": results}


# -- running ------------------------------------------------------------------------------

def run_elasticrun(argv: list[str], env: Mapping[str, str], timeout: float | None,
                   quiet: bool) -> tuple[int | None, list[str]]:
    """Run elasticrun; returns (exit code or None on timeout, the tail of its stderr)."""
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    errors: collections.deque[str] = collections.deque(maxlen=_OUTPUT_TAIL_LINES)
    pumps = [threading.Thread(target=pump_output,
                              args=(proc.stdout, _pass_through("stdout", quiet, None)),
                              daemon=True),
             threading.Thread(target=pump_output,
                              args=(proc.stderr, _pass_through("stderr", quiet, errors)),
                              daemon=True)]
    for pump in pumps:
        pump.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            try:
                code = proc.wait(0.1)
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() > deadline:
                    _terminate(proc)
                    code = None
                    break
    except BaseException:
        # KeyboardInterrupt in a notebook or script: stop the job, then re-raise.
        _terminate(proc)
        raise
    finally:
        for pump in pumps:
            pump.join(5.0)
    return code, list(errors)


def _pass_through(name: str, quiet: bool, keep: collections.deque[str] | None,
                  ) -> Callable[[bytes], None]:
    """A line handler: keep the line (``keep``: a deque, or None), echo it unless quiet."""
    def handle(raw: bytes) -> None:
        line = raw.decode("utf-8", "replace")
        if keep is not None:
            keep.append(line)
        if not quiet:
            target = sys.stdout if name == "stdout" else sys.stderr
            try:
                target.write(line + "\n")
                target.flush()
            except (OSError, ValueError):
                pass
    return handle


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM: elasticrun stops its workers and exits; SIGKILL if it does not."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(_TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass


# -- results and errors -------------------------------------------------------------------

class Outcome:
    """What the finished job left behind: results, error records, logs, events."""

    def __init__(self, results_dir: str, log_dir: str | None, event_log: str,
                 driver_log: Iterable[str]) -> None:
        self.results_dir = results_dir
        self.log_dir = log_dir
        self.events = _read_events(event_log)
        self.driver_log = [line for line in driver_log if line.startswith("elasticrun: ")]

    def results(self, code: int) -> list[Any]:
        errors = [line for line in self.driver_log if line.startswith("elasticrun: error:")]
        error_line = errors[-1] if errors else None
        if code != 0:
            why = error_line[len("elasticrun: error: "):] if error_line else \
                f"elasticrun exited with code {code}"
            return self._raise(why, error_line, code)
        final = self._final_round()
        if final is None:
            rounds = sorted(int(d.split(".", 1)[1]) for d in os.listdir(self.results_dir)
                            if d.startswith("round."))
            if not rounds:
                raise self.error("the job finished but no worker returned a result", code)
            final = {"round": rounds[-1], "members": None}
        records = self._records(final["round"])
        members = final["members"]
        size = len(members) if members is not None else \
            (next(iter(records.values()))["size"] if records else 0)
        missing = [r for r in range(size) if r not in records]
        if missing or not size:
            by_rank = {m["rank"]: m for m in members or []}
            failed = by_rank.get(missing[0]) if missing else None
            raise self.error(f"the job ended but rank(s) {missing or [0]} of its final round "
                             f"(round {final['round']}) returned no result", code,
                             failed and failed["worker_id"], host=failed and failed["host"])
        return [records[r]["value"] for r in range(size)]

    def _raise(self, why: str, error_line: str | None, code: int) -> NoReturn:
        named = _WORKER_RE.search(error_line or "")
        raise self.error(why, code, named.group(1) if named else None,
                         host=named.group(2) if named else None, error_line=error_line)

    def error(self, why: str, code: int | None, wid: str | None = None, host: str | None = None,
              error_line: str | None = None) -> LaunchError:
        """A LaunchError about worker ``wid``: what its function raised, what
        elasticrun said, and the tail of its stderr."""
        records = self._error_records()
        record = records.get(wid) if wid is not None else None
        if record is None and records:
            # No record from the named worker (or none named): the first worker whose
            # function raised tells the most.
            raiser = sorted(records, key=_id_key)[0]
            record = records[raiser]
            wid = raiser if wid is None else wid
        record = record or {}
        if record.get("worker") == wid:
            host = host or record.get("host")
        if wid is None:
            lines = [why]
        else:
            lines = [f"worker {wid}" + (f" on {host}" if host else "") + " failed"]
            if record:
                lines[0] += f": {record['type']}: {record['message']}"
                if record["worker"] != wid:
                    lines[0] += f" (raised on worker {record['worker']})"
            lines.append(error_line or why)
            # What the driver said about this worker (e.g. its exit code).
            lines.extend([line for line in self.driver_log if f"worker {wid} " in line
                          and line != error_line][-2:])
        tail = self._stderr_tail(wid) if wid is not None else None
        if tail:
            lines.append(f"--- last lines of worker {wid}'s stderr ---")
            lines.append(tail)
        return LaunchError(
            "\n".join(lines), worker=wid, host=host, rank=record.get("rank"), exit_code=code,
            error_line=error_line, exc_type=record.get("type"), exc_message=record.get("message"),
            remote_traceback=record.get("traceback"), stderr_tail=tail,
            failed_at=record.get("time"), root_cause=self.root_cause() or None)

    def root_cause(self) -> list[str]:
        """elasticrun's root-cause block: from its first line to the error line."""
        start = next((i for i, line in enumerate(self.driver_log) if " root cause" in line
                      and ": worker " in line), None)
        if start is None:
            return []
        block = [self.driver_log[start]]
        for line in self.driver_log[start + 1:]:
            if not line.startswith("elasticrun:   "):
                break
            block.append(line)
        return block

    def _final_round(self) -> dict[str, Any] | None:
        finished = [e for e in self.events if e.get("event") == "job_finished"]
        if not finished:
            return None
        round_id = finished[-1].get("round")
        members = None
        for e in self.events:
            if e.get("event") == "round_started" and e.get("round") == round_id:
                members = e.get("members")
        return {"round": round_id, "members": members}

    def _records(self, round_id: object) -> dict[int, Any]:
        folder = os.path.join(self.results_dir, f"round.{round_id}")
        records: dict[int, Any] = {}
        if not os.path.isdir(folder):
            return records
        for name in os.listdir(folder):
            if not name.endswith(".pkl"):
                continue
            with open(os.path.join(folder, name), "rb") as f:
                record = cloudpickle.loads(f.read())
            records[record["rank"]] = record
        return records

    def _error_records(self) -> dict[str, Any]:
        folder = os.path.join(self.results_dir, ERRORS)
        records = {}
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if name.endswith(".json"):
                try:
                    with open(os.path.join(folder, name)) as f:
                        record = json.load(f)
                    records[str(record["worker"])] = record
                except (OSError, ValueError, KeyError):
                    continue
        return records

    def _stderr_tail(self, wid: str) -> str | None:
        path = os.path.join(self.log_dir or "", f"worker.{wid}", "stderr")
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return None
        lines = text.splitlines()[-STDERR_TAIL_LINES:]
        return "\n".join(lines) if lines else None


def _read_events(path: str) -> list[Any]:
    try:
        events = read_json_lines(path)
    except OSError:
        return []
    # A user's event log may hold earlier jobs: keep only this one, from its last start.
    starts = [i for i, e in enumerate(events) if e.get("event") == "round_started"
              and e.get("round") == 1]
    return events[starts[-1]:] if starts else events


def _id_key(wid: str) -> tuple[int, int, str]:
    return (0, int(wid), "") if str(wid).isdigit() else (1, 0, str(wid))
