"""Which addresses a TCP port listens on, read from /proc/net/tcp{,6} (what `ss -ltn` shows)."""

import ipaddress
import socket
import struct

_LISTEN = "0A"


def _decode(hex_addr, family):
    raw = bytes.fromhex(hex_addr)
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    words = struct.unpack("<4I", raw)
    addr = ipaddress.IPv6Address(struct.pack(">4I", *words))
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def listening_sockets(port):
    """{(address, port)} of the sockets listening on TCP ``port``."""
    found = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            hex_addr, hex_port = local.split(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                found.add((_decode(hex_addr, family), port))
    return found
