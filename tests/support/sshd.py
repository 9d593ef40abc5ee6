"""A throwaway sshd on loopback, for tests that launch workers over real ssh.

Everything lives in one temporary directory: a fresh host key, a fresh client
key, authorized_keys, a known_hosts that names the host key for each test
address, and the sshd config. sshd listens on 127.0.0.2 and 127.0.0.3 (or the
next free loopback addresses that elasticrun treats as remote) on a free
port. Host keys are checked for real: the client gets the known_hosts file.

Tests skip only when sshd, ssh or ssh-keygen is not installed (``make
install`` installs openssh-server when run as root).
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.runner import launcher

START_TIMEOUT_S = 60
CANDIDATES = [f"127.0.0.{n}" for n in range(2, 30)]


def _find_sshd():
    for path in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if path and os.access(path, os.X_OK):
            return path
    return None


def _free_port(addr):
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _accepts(addr, port):
    try:
        with socket.create_connection((addr, port), timeout=2) as s:
            s.settimeout(5)
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


class Sshd:
    """A running sshd; ``args`` are the elasticrun flags that reach it."""

    def __init__(self, directory, addrs, unused_addr):
        self.dir = Path(directory)
        self.addrs = addrs                  # hosts served by this sshd
        self.unused_addr = unused_addr      # a remote loopback address nobody serves
        self.host_key = self.dir / "host_key"
        self.client_key = self.dir / "client_key"
        self.authorized_keys = self.dir / "authorized_keys"
        self.known_hosts = self.dir / "known_hosts"
        self.config = self.dir / "sshd_config"
        self.log = self.dir / "sshd.log"
        self.port = None
        self.proc = None

    # -- set-up -------------------------------------------------------------------------
    def _keys(self):
        for path in (self.host_key, self.client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "elastic-test",
                            "-f", str(path)], check=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        self.authorized_keys.write_text(Path(f"{self.client_key}.pub").read_text())
        self.authorized_keys.chmod(0o600)

    def _write_config(self):
        kind, blob = Path(f"{self.host_key}.pub").read_text().split()[:2]
        self.known_hosts.write_text("".join(f"[{a}]:{self.port} {kind} {blob}\n"
                                            for a in self.addrs))
        lines = [f"Port {self.port}"] + [f"ListenAddress {a}" for a in self.addrs] + [
            f"HostKey {self.host_key}",
            f"PidFile {self.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "StrictModes no",
            "UsePAM no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "MaxStartups 100",
            "MaxSessions 100",
            "LogLevel VERBOSE",
        ]
        self.config.write_text("\n".join(lines) + "\n")

    def start(self):
        sshd = _find_sshd()
        self._keys()
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # privilege separation
        last = ""
        for _ in range(3):     # a free port can be taken between probe and bind
            self.port = _free_port(self.addrs[0])
            self._write_config()
            log = open(self.log, "ab")
            self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(self.config)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
            log.close()
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and self.proc.poll() is None:
                if all(_accepts(a, self.port) for a in self.addrs):
                    self._check_login()
                    return self
                time.sleep(0.1)
            self.stop()
            last = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"sshd did not start:\n{last}")

    def _check_login(self):
        """One real login, so a broken set-up fails here with sshd's own words."""
        for addr in self.addrs:
            done = subprocess.run(self.ssh_argv(addr) + ["true"], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"ssh to the test sshd at {addr}:{self.port} failed: "
                                   f"{done.stderr.strip()}\n"
                                   f"{self.log.read_text(errors='replace')[-2000:]}")

    # -- use ------------------------------------------------------------------------------
    @property
    def options(self):
        return [f"UserKnownHostsFile={self.known_hosts}", "GlobalKnownHostsFile=/dev/null",
                "IdentitiesOnly=yes"]

    @property
    def args(self):
        """elasticrun flags for hosts behind this sshd."""
        args = ["-p", str(self.port), "-i", str(self.client_key),
                "--remote-python", sys.executable]
        for option in self.options:
            args += ["--ssh-option", option]
        return args

    def ssh_argv(self, addr):
        argv = ["ssh", "-T", "-p", str(self.port), "-i", str(self.client_key),
                "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
        for option in self.options:
            argv += ["-o", option]
        return argv + [addr]

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def remote_loopback_addresses(count):
    """Loopback addresses that elasticrun treats as remote under ELASTIC_SSH_LOOPBACK=1."""
    names = launcher.local_names()
    found = [a for a in CANDIDATES if not launcher.is_local(a, names, ssh_loopback=True)]
    return found[:count]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    missing = [tool for tool, found in (("sshd", _find_sshd()), ("ssh", shutil.which("ssh")),
                                        ("ssh-keygen", shutil.which("ssh-keygen")))
               if not found]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (make install installs "
                    "openssh-server when run as root)")
    addrs = remote_loopback_addresses(3)
    if len(addrs) < 3:
        pytest.skip("no loopback addresses outside this machine's own names")
    server = Sshd(tmp_path_factory.mktemp("sshd"), addrs[:2], addrs[2])
    try:
        yield server.start()
    finally:
        server.stop()
