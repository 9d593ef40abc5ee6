"""A warm spare: a Python process that imports torch once, then forks each worker the
driver starts on its machine (``elasticrun --warm-spare``).

A replacement started after a crash spends seconds importing torch, and on a loaded
host far more, while its peers train without it or wait for it. The driver keeps one
spare per local host (runner/spares.py): ``python spare.py``, started with a worker's
environment once a round runs, its stdin one end of a ``SOCK_SEQPACKET`` socket pair.
The spare imports the heavy modules, says ``{"ready": true}``, then serves. For each
worker the driver sends the worker's spec (its environment and ``[script, args...]``)
as JSON with two file descriptors, the write ends of the worker's stdout and stderr
pipes. The spare forks: the child takes them as its output, starts a session of its
own, dies with the spare (``PR_SET_PDEATHSIG``; the spare dies with the driver), takes
the spec's environment as its own and runs the script as ``__main__``, as ``python
script args`` would; the interpreter then exits as that script's would. The spare
answers ``{"pid": N}`` and, when the child ends, ``{"exit": N, "code": C}`` (negative:
the signal), which is how the driver learns a forked worker's exit code.

A fork costs milliseconds and no imports, so the spare serves every replacement of the
job without importing torch again beside the training (each import there slowed the
training's steps by about a tenth: ``BENCH_ONLY=spawn``). End of input (the driver
closed it, or died) ends the spare, and with it any worker it forked still running.

Importing is all the spare does before it forks. elastic's modules read the environment
when they are called, never at import (tests/test_warm_spare.py checks it), so importing
them early changes nothing the worker sees; torch, imported with ``OMP_NUM_THREADS`` as
the worker's, starts no thread at import, so the fork copies a single-threaded process.
"""

import array
import json
import os
import runpy
import select
import signal
import socket
import sys

# Imported ahead of need; each is what a replacement would otherwise import after the
# crash (torch._dynamo: the optimizer's first step pulls it in).
PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo", "elastic",
           "elastic.torch")
PR_SET_PDEATHSIG = 1
MAX_SPEC_BYTES = 1 << 20


def preload(names: tuple[str, ...] = PRELOAD) -> None:
    import importlib
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the worker imports it again and sees the error
            pass


def _die_with_parent() -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _child(spare_pid: int, conn: socket.socket, fds: list[int], wake: int) -> None:
    """In the forked child: become a fresh worker process, bar the imports."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake)
    conn.close()
    os.setsid()
    _die_with_parent()
    if os.getppid() != spare_pid:       # the spare died before the line above
        os._exit(1)
    if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(0) == os.SCHED_IDLE:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass                        # the driver puts it back (runner/priority.py)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(fd, target)
    for fd in {devnull, *fds}:
        if fd > 2:
            os.close(fd)


def become(spec: dict) -> None:
    """Take the worker's environment and argv, then run its script as ``__main__``."""
    argv = [str(a) for a in spec["argv"]]
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in spec["env"].items()})
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def _send(conn: socket.socket, message: dict) -> None:
    conn.send(json.dumps(message).encode())


def _reap(conn: socket.socket, children: set) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _send(conn, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(conn: socket.socket) -> dict | None:
    """Fork a worker per spec; returns a spec only in a forked child, None at the end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    _send(conn, {"ready": True})
    while True:
        readable, _, _ = select.select([conn, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(conn, children)
        if conn not in readable:
            continue
        fds = array.array("i")
        data, ancdata, _flags, _addr = conn.recvmsg(MAX_SPEC_BYTES, socket.CMSG_SPACE(8))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not data:
            return None                      # the driver closed it: this spare's end
        spare_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(spare_pid, conn, list(fds), wake_r)
            os.close(wake_w)
            return json.loads(data)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        _send(conn, {"pid": pid})


def main() -> int:
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)          # run by path: this folder's modules must not shadow others
    preload()
    conn = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    spec = serve(conn)
    if spec is None:
        return 0
    become(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
