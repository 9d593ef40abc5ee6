"""Where the driver's control store listens: nowhere it does not need to.

TCPStore has no authentication, so the fewer machines that can reach its port
the better (values are sealed anyway, see elastic/auth.py). Every host local:
loopback. Otherwise the ``--network-interface`` address, or the one local
address this machine uses towards the remote hosts (a UDP connect() picks it
without sending anything). Only when remote hosts are reached from several
local addresses does it listen on every interface, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from elastic.runner import launcher

LOOPBACK = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"


@dataclass(frozen=True)
class Binding:
    address: str        # what the store listens on
    reason: str         # said in the driver's log

    @property
    def loopback_only(self) -> bool:
        return self.address.startswith("127.") or self.address == "::1"

    @property
    def specific(self) -> bool:
        return self.address not in (EVERY_INTERFACE, "::")

    def local_connect_address(self) -> str:
        """The address this machine's own workers connect to."""
        return self.address if self.specific else LOOPBACK

    def remote_connect_address(self) -> str | None:
        """The address remote workers connect to; None: per host (every interface)."""
        return self.address if self.specific else None

    def reaches(self, host: str, names: Collection[str] | None) -> bool:
        """Whether workers on ``host`` can connect to the store."""
        return not self.loopback_only or launcher.is_local(host, names)


def choose(hosts: Iterable[str], names: Collection[str] | None,
           network_interface: str | None = None, serving: bool = False,
           source_address: Callable[[str], str | None] = launcher.source_address) -> Binding:
    """The Binding for a job on ``hosts`` (OSError: a bad --network-interface).
    ``serving``: agents join from hosts not known yet (elasticrun --serve)."""
    if network_interface:
        addr = launcher.interface_ipv4(network_interface)
        return Binding(addr, f"--network-interface {network_interface}")
    if serving:
        return Binding(EVERY_INTERFACE, "--serve: agents join from other hosts; pass "
                                        "--network-interface to listen on one")
    remote = sorted(h for h in hosts if not launcher.is_local(h, names))
    if not remote:
        return Binding(LOOPBACK, "every host is local")
    sources = {source_address(h) for h in remote}
    source = next(iter(sources)) if len(sources) == 1 else None
    if source is not None:
        return Binding(source, f"the address that routes to {', '.join(remote[:3])}"
                             f"{' ...' if len(remote) > 3 else ''}")
    return Binding(EVERY_INTERFACE, "remote hosts are reached from several local addresses "
                                    "(or have no route); pass --network-interface to listen "
                                    "on one")
