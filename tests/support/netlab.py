"""A network lab: each "host" is its own network namespace on one bridge.

Loopback cannot be partitioned (gloo binds every 127.0.0.x worker to 127.0.0.1),
so tests that cut, delay or drop links need hosts with addresses of their own:

    switch namespace:   br0 ── p1 ── p2 ── ...        (a bridge, one port per host)
    host namespaces:    eth0 10.0.0.1/24, eth0 10.0.0.2/24, ...  (each a veth to its port)

Everything is made by the test and torn down after it (``ip netns del``), and
nothing touches the machine's own namespace: labs of tests that run at the same
time only need different names, which each lab draws at random.

Faults use what this kernel offers (measured: namespaces, veth, bridges, blackhole
and prohibit routes, ``ip rule``, link state; no netem, no iptables): ``cut`` adds a
blackhole (silent drop) or prohibit (refusal) route, one way or both, ``link_down``
takes a host's link down. ``netem`` raises Unsupported where the qdisc is missing.

Hosts run elasticrun's remote path for real (remote.py, the spec on stdin,
signals, stdin end): ``ssh_shim`` is an ``ssh`` for the driver's PATH that runs
the remote command with ``ip netns exec`` in the namespace of the host's address
instead of over a network login (the lab's links stay the only network between
hosts). ``pytest`` fixture: ``lab`` (skips with one reason where namespaces are refused).
"""

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

SUBNET = "10.0.0"


class Unsupported(Exception):
    """The kernel or the tools here cannot stage this fault; str() says why."""


def _ip(*args, check=True):
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def why_no_lab():
    """None when this machine can build a lab; else the one reason it cannot."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "the network lab needs iproute2's ip"
    probe = f"elprobe{secrets.token_hex(3)}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"network namespaces are refused here: {done.stderr.strip()}"
    try:
        made = _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
                   check=False)
        if made.returncode != 0:
            return f"veth pairs are refused here: {made.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def tc_rate_bits(rate):
    """Bits per second of a tc rate such as "300mbit", "1gbit" or "50000kbit"."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * scale)
    raise ValueError(f"unknown rate {rate!r} (use e.g. 300mbit or 1gbit)")


class Host:
    def __init__(self, lab, index, name):
        self.lab, self.index, self.name = lab, index, name
        self.ns = f"{lab.id}-{name}"
        self.addr = f"{SUBNET}.{index}"
        self.port = f"p{index}"            # its bridge port in the switch namespace

    def run(self, *argv, check=True, **kwargs):
        """Run ``argv`` inside this host's namespace."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], check=check,
                              capture_output=True, text=True, timeout=60, **kwargs)

    def prefix(self):
        """An argv prefix that runs a command in this host's namespace."""
        return ["ip", "netns", "exec", self.ns]

    def __repr__(self):
        return f"Host({self.name}, {self.addr})"


class Lab:
    def __init__(self, directory):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.id = f"el{secrets.token_hex(3)}"
        self.switch = f"{self.id}-sw"
        self.hosts = {}
        self._routes = set()          # (host name, kind, address) routes added by cut()
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def host(self, name):
        """A new host: its own namespace, link and address on the lab's bridge."""
        host = Host(self, len(self.hosts) + 1, name)
        _ip("netns", "add", host.ns)
        _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
            "netns", host.ns)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.port, "up")
        _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        self.hosts[name] = host
        self._write_map()
        return host

    # -- faults -------------------------------------------------------------------------
    def cut(self, a, b, one_way=False, kind="blackhole"):
        """Packets from ``a`` to ``b`` (and back, unless ``one_way``) are dropped
        (``blackhole``) or refused (``prohibit``), by a route in each sender."""
        pairs = [(a, b)] if one_way else [(a, b), (b, a)]
        for src, dst in pairs:
            _ip("-n", src.ns, "route", "add", kind, f"{dst.addr}/32")
            self._routes.add((src.name, kind, dst.addr))

    def restore(self, a, b):
        for src, dst in ((a, b), (b, a)):
            for kind in ("blackhole", "prohibit"):
                if (src.name, kind, dst.addr) in self._routes:
                    _ip("-n", src.ns, "route", "del", kind, f"{dst.addr}/32")
                    self._routes.discard((src.name, kind, dst.addr))

    def link_down(self, host):
        _ip("-n", host.ns, "link", "set", "eth0", "down")

    def link_up(self, host):
        _ip("-n", host.ns, "link", "set", "eth0", "up")

    def shape(self, host, up=None, down=None):
        """Rate-limit a host's link with ``tbf`` (rates as tc writes them, "300mbit"):
        ``up`` what it sends (its eth0), ``down`` what it receives (its bridge port).
        None leaves that direction as it is; the lab's namespaces go with close()."""
        if shutil.which("tc") is None:
            raise Unsupported("tc (iproute2) is not installed")
        for ns, dev, rate in ((host.ns, "eth0", up), (self.switch, host.port, down)):
            if rate is None:
                continue
            # burst: a few GSO super-packets (tbf splits what exceeds it) and at least
            # one timer tick of the rate; latency bounds the queue.
            burst = max(256 << 10, tc_rate_bits(rate) // 8 // 100)
            done = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root",
                                   "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise Unsupported(f"tc tbf on {dev} was refused: {done.stderr.strip()}")

    def netem(self, host, *spec):
        """``tc qdisc ... netem SPEC`` on the host's link; Unsupported where netem is missing."""
        if shutil.which("tc") is None:
            raise Unsupported("tc (iproute2) is not installed")
        done = host.run("tc", "qdisc", "add", "dev", "eth0", "root", "netem", *spec,
                        check=False)
        if done.returncode != 0:
            raise Unsupported(f"this kernel has no netem qdisc ({done.stderr.strip()})")

    # -- launching ----------------------------------------------------------------------
    def _write_map(self):
        (self.dir / "hosts.map").write_text(
            "".join(f"{h.addr} {h.ns}\n" for h in self.hosts.values()))

    def ssh_shim(self, client):
        """A directory holding an ``ssh`` for the driver's PATH: the remote command runs
        in the namespace of the host's address; ``client`` is the driver's host (its
        address is what sshd would put in SSH_CONNECTION)."""
        shim = self.dir / "bin"
        shim.mkdir(exist_ok=True)
        script = shim / "ssh"
        script.write_text(f"""#!/bin/sh
# netlab's ssh: elasticrun's remote command, in the network namespace of the host.
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do shift; done
shift
host="$1"; shift
ns=$(awk -v h="$host" '$1 == h {{print $2}}' {self.dir / 'hosts.map'})
if [ -z "$ns" ]; then
    echo "ssh: connect to host $host port 22: No route to host" >&2
    exit 255
fi
export SSH_CONNECTION="{client.addr} 40000 $host 22"
exec ip netns exec "$ns" sh -c "$*"
""")
        script.chmod(0o755)
        return shim

    def close(self):
        """Kill what still runs in the lab's namespaces, then delete them."""
        for host in list(self.hosts.values()) + [None]:
            ns = host.ns if host else self.switch
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            deadline = time.monotonic() + 10
            while _ip("netns", "pids", ns, check=False).stdout.split() and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            _ip("netns", "del", ns, check=False)


def lab_job(tmp_path, lab, driver, args, env=None):
    """A tests/support/jobs.py Job whose driver runs in ``driver``'s namespace and reaches the
    other hosts through the lab's ssh shim; gloo and the store use each namespace's eth0."""
    import sys

    from support.jobs import Job
    shim = lab.ssh_shim(driver)
    job = Job(tmp_path, ["--network-interface", "eth0", "--remote-python", sys.executable]
              + list(args), env=dict(env or {}, PATH=f"{shim}{os.pathsep}{os.environ['PATH']}"))
    job.prefix = driver.prefix()
    return job


@pytest.fixture
def lab(tmp_path):
    reason = why_no_lab()
    if reason:
        pytest.skip(reason)
    made = Lab(tmp_path / "lab")
    try:
        yield made
    finally:
        made.close()
