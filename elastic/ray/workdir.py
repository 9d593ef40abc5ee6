"""The Ray executor's work directory on a node: private all the way down, and a
payload (fn.pkl, which workers unpickle) that only this job wrote.

The work directory has the same path on every node (/tmp/elastic-ray-XXXX, made
by mkdtemp on the driver's node only). On another node that path may already
exist, made by someone else with a fn.pkl of their choosing: reusing it would
run their code in every worker. So each directory from the work directory down
is made 0700, or must already be a directory (not a link) owned by this user,
and is then made 0700; an existing fn.pkl is used only if it is a plain 0600 file
of this user holding exactly this job's payload. Anything else is refused.
"""

from __future__ import annotations

import os
import stat

from elastic.exceptions import ElasticError


class UnsafeWorkdir(ElasticError):
    """The work directory or its payload is not this job's own; str() says which."""


def private_dir(path: str) -> None:
    """Make ``path`` (one level) a 0700 directory of this user, or refuse."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise UnsafeWorkdir(f"{path} exists and is not a directory of this user: refusing it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def private_tree(workdir: str, *below: str) -> None:
    """``workdir`` and each directory ``below`` it (relative paths), all 0700, ours."""
    private_dir(workdir)
    for rel in below:
        path = workdir
        for part in rel.split("/"):
            path = os.path.join(path, part)
            private_dir(path)


def place_payload(workdir: str, payload: bytes) -> str:
    """The path of fn.pkl in ``workdir`` holding ``payload``, written by us, or refuse."""
    path = os.path.join(workdir, "fn.pkl")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        tmp = f"{path}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        raise UnsafeWorkdir(f"{path}: {exc.strerror}: refusing it") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        same = f.read() == payload
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
            or stat.S_IMODE(st.st_mode) != 0o600 or not same:
        raise UnsafeWorkdir(f"{path} exists and was not written by this job: refusing it")
    return path
