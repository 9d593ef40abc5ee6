"""An outsider: a process that reaches the driver's store port but has no job secret.

It sees every key (list_keys), reads every value (values are sealed, not
encrypted), and writes what it likes: garbage, forged seals, values copied from
other keys or rounds, counter bumps. It never reads the secret.
"""

import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

FAKE_MAC = b"0" * 64


class Outsider:
    def __init__(self, addr, port, timeout=10):
        self.addr, self.port, self.timeout = addr, int(port), timeout
        self._lock = threading.Lock()
        self._store = self._connect()
        self.writes = []                 # (key, what) of every write made

    def _connect(self):
        return dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=self.timeout), use_libuv=True)

    def _call(self, name, *args):
        with self._lock:
            if self._store is None:
                return None
            try:
                return getattr(self._store, name)(*args)
            except Exception:  # noqa: BLE001 - the store closed us; come back on a new connection
                try:
                    self._store = self._connect()
                except Exception:  # noqa: BLE001 - the job is gone
                    self._store = None
                return None

    def close(self):
        with self._lock:
            self._store = None

    def keys(self):
        return self._call("list_keys") or []

    def namespace(self, timeout=120, marks=("//worker/", "//round/")):
        """The job's key prefix, as list_keys shows it (it hides nothing): the workers'
        by default; ``marks=("//agent/",)`` finds the agents' (another key's namespace)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for key in self.keys():
                if any(mark in key for mark in marks):
                    return key.split("//", 1)[0] + "//"
            time.sleep(0.02)
        raise AssertionError("no job keys visible to list_keys()")

    def get(self, key):
        if not self._call("check", [key]):
            return None
        value = self._call("get", key)
        return None if value is None else bytes(value)

    def payload(self, key):
        """The JSON inside a sealed value: readable by anyone."""
        blob = self.get(key)
        return json.loads(blob.split(b".", 2)[2]) if blob else None

    def set(self, key, blob, what):
        self._call("set", key, blob)
        self.writes.append((key, what))

    def set_many(self, keys, blob, what):
        """One multi_set: as many keys as it likes, in a single write."""
        keys = list(keys)
        self._call("multi_set", keys, [blob] * len(keys))
        self.writes.append((f"{len(keys)} keys", what))

    def delete(self, key, what):
        self._call("delete_key", key)
        self.writes.append((key, what))

    def bump(self, key, what):
        """add(key, 1): on a key holding a non-number the store drops our connection."""
        self._call("add", key, 1)
        self.writes.append((key, what))

    def forgeries(self, key, replay_from=None):
        """Garbage, a zero MAC, and (if given) a value sealed for another key."""
        self.set(key, b"garbage", "garbage")
        self.set(key, FAKE_MAC + b".1." + json.dumps({"round": 1}).encode(), "forged seal")
        if replay_from is not None:
            self.set(key, replay_from, "replayed value of another key")


class FirstSightVandal(threading.Thread):
    """Overwrites every key of the job once, with garbage, right after it first
    appears: the worst timing for readers, and still a single write per key."""

    def __init__(self, outsider, namespace, skip=(), every=0.01):
        super().__init__(name="vandal", daemon=True)
        # ``namespace``: a prefix, or a tuple of them (the workers' and the agents').
        self.o, self.ns, self.skip, self.every = outsider, namespace, tuple(skip), every
        self.hit = set()
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            for key in self.o.keys():
                if key.startswith(self.ns) and key not in self.hit \
                        and not any(s in key for s in self.skip):
                    self.hit.add(key)
                    self.o.set(key, b"vandalised", "overwritten at first sight")
            self._halt.wait(self.every)

    def stop(self):
        self._halt.set()
        self.join(30)
        self.o.close()
