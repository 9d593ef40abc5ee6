"""The control store listens only where the job needs it (elastic/runner/binding.py)."""

import socket
import subprocess
import sys

import pytest
from support.listening import listening_sockets

from elastic import protocol as control
from elastic.runner import binding

NAMES = {"localhost", "127.0.0.1", "me"}


def test_every_host_local_means_loopback():
    b = binding.choose({"localhost": 2, "127.0.0.1": 2, "me": 1}, NAMES)
    assert b.address == "127.0.0.1" and b.reason == "every host is local"
    assert b.local_connect_address() == "127.0.0.1"
    assert not b.reaches("10.1.2.3", NAMES) and b.reaches("localhost", NAMES)


def test_serving_agents_listens_everywhere_unless_an_interface_is_given():
    assert binding.choose({}, NAMES, serving=True).address == "0.0.0.0"
    assert binding.choose({}, NAMES, network_interface="lo", serving=True).address == "127.0.0.1"


def test_network_interface_decides():
    b = binding.choose({"10.1.2.3": 1}, NAMES, network_interface="lo")
    assert b.address == "127.0.0.1" and "--network-interface lo" in b.reason
    with pytest.raises(OSError):
        binding.choose({"localhost": 1}, NAMES, network_interface="nosuchif0")


def test_remote_hosts_get_the_address_that_routes_to_them():
    routes = {"10.1.2.3": "10.1.0.9", "10.1.2.4": "10.1.0.9", "192.168.5.5": "192.168.5.1"}
    b = binding.choose({"localhost": 1, "10.1.2.3": 1, "10.1.2.4": 1}, NAMES,
                       source_address=routes.get)
    assert b.address == "10.1.0.9" and "10.1.2.3" in b.reason
    assert b.local_connect_address() == b.remote_connect_address() == "10.1.0.9"
    assert b.reaches("10.1.2.3", NAMES)
    # Reached from two local addresses: every interface, and the log says why.
    b = binding.choose({"10.1.2.3": 1, "192.168.5.5": 1}, NAMES, source_address=routes.get)
    assert b.address == "0.0.0.0" and "--network-interface" in b.reason
    assert b.local_connect_address() == "127.0.0.1" and b.remote_connect_address() is None
    # No route at all: the same.
    assert binding.choose({"10.9.9.9": 1}, NAMES, source_address=lambda h: None).address \
        == "0.0.0.0"


def test_the_store_listens_on_the_address_it_was_given():
    store = control.listen("127.0.0.1", 10)
    try:
        assert listening_sockets(store.port) == {("127.0.0.1", store.port)}
        # It is a working store, reachable there and nowhere else.
        conn = control.connect("127.0.0.1", store.port, 10)
        conn.set("k", b"v")
        assert bytes(store.get("k")) == b"v"
        other = _non_loopback_address()
        if other:
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((other, store.port)) != 0
        del conn
    finally:
        del store


def test_plain_tcpstore_would_listen_everywhere():
    """Why listen() makes the socket itself: TCPStore ignores its host argument."""
    code = ("import torch.distributed as d, datetime, sys\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,"
            " timeout=datetime.timedelta(seconds=5))\n"
            "sys.stdout.write(str(s.port) + '\\n'); sys.stdout.flush(); sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        assert {addr for addr, _ in listening_sockets(port)} & {"0.0.0.0", "::"}
    finally:
        proc.stdin.close()
        proc.wait(30)


def _non_loopback_address():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr
