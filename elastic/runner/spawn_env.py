"""Which variables a driver's spawn request may set on an agent's host.

A spawn request is sealed, but whoever can seal one (the driver, or anyone holding
the key) would otherwise choose the loader and interpreter of every process the
agent starts: ``LD_PRELOAD`` or ``PYTHONPATH`` is code execution on every agent.
So names that steer a loader, an interpreter or a shell are dropped from requests
(one warning per name) unless the agent is started with an explicit allow-list:
``ELASTIC_AGENT_ALLOW_ENV="PYTHONPATH,LD_LIBRARY_PATH"`` (exact names, or a prefix
ending in ``*``). The agent sets what workers need itself (PYTHONUNBUFFERED).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

from elastic.protocol import ENV_AGENT_ALLOW_ENV, ENV_SECRET, ENV_SECRET_FD, ENV_SECRET_FILE

ENV_ALLOW = ENV_AGENT_ALLOW_ENV
DENIED_PREFIXES = ("LD_", "DYLD_", "PYTHON", "GCONV_", "MALLOC_", "BASH_FUNC_", "PERL",
                   "RUBY", "NODE_", "JAVA_TOOL", "_JAVA_", "GLIBC_")
DENIED_NAMES = frozenset({"BASH_ENV", "ENV", "PATH", "IFS", "SHELLOPTS", "BASHOPTS", "PS4",
                          "HOSTALIASES", "LOCALDOMAIN", "RES_OPTIONS", "NLSPATH", "LOCPATH",
                          "TMPDIR", "HOME", "SHELL", "CDPATH", "PROMPT_COMMAND"})


def allow_list(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The agent's explicit allow-list (names, or prefixes ending in *)."""
    text = (os.environ if environ is None else environ).get(ENV_ALLOW, "")
    return tuple(p.strip() for p in text.split(",") if p.strip())


def allowed(name: str, allow: Iterable[str] = ()) -> bool:
    for pattern in allow:
        if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return True
    return name not in DENIED_NAMES and not name.startswith(DENIED_PREFIXES)


def split(requested: Mapping[object, object], allow: Iterable[str] = (),
          ) -> tuple[dict[str, str], list[str]]:
    """({name: value} the agent applies, [names it drops]) of a spawn request's env."""
    kept: dict[str, str] = {}
    dropped: list[str] = []
    for name, value in requested.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            continue
        if allowed(name, allow):
            kept[name] = str(value)
        else:
            dropped.append(name)
    return kept, sorted(dropped)


_WARNED: set[str] = set()   # names this agent already warned about


def request_env(requested: object, warned: set[str], warn: Callable[[str], None],
                ) -> dict[str, str]:
    """What of a spawn request's env the agent applies; one ``warn`` per dropped name
    (``warned`` remembers them)."""
    kept, dropped = split(requested if isinstance(requested, dict) else {}, allow_list())
    for name in set(dropped) - warned:
        warned.add(name)
        warn(f"a spawn request set {name}: ignored (an agent applies loader and interpreter "
             f"variables only when {ENV_ALLOW} names them)")
    return kept


def worker_env(requested: object, warn: Callable[[str], None], own: Mapping[str, str],
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker an agent starts: the agent's own (``base``, default
    os.environ) without any secret, what the request may set, then ``own``."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in (ENV_SECRET, ENV_SECRET_FILE, ENV_SECRET_FD)}
    env.update(request_env(requested, _WARNED, warn))
    env.update(own)
    return env
