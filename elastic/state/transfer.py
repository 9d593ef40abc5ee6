"""Moving a commit to the ranks that lack it: one pipelined chain, striped over senders.

The bytes to move are the per-dtype flat buffers of a snapshot (elastic.state.snapshot),
cut into chunks of ``CHUNK_BYTES``. The receivers form one chain in rank order:
the first receives each chunk from a sender and every receiver forwards each chunk
to the next one as soon as it has landed, so with any number of receivers each
link carries the state once and the senders send it once in total (a broadcast
tree without its log n factor; a root sending to each receiver in turn sends it
n-1 times). When k ranks hold the same commit unchanged, chunk c comes from
sender c mod k (striping): each sender reads and sends a disjoint 1/k share.

Everything here runs on a helper thread that the caller waits on in abort-watching
slices (``collectives.run_blocking``): point-to-point gloo work cannot be waited on
in slices itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

# A chain adds one chunk's time per hop, and k senders' shares differ by up to one chunk:
# on a 300 Mbit/s link 2 MB is 56 ms (8 MB was 224 ms and left 3 senders 42/42/36 MB of
# 120 MB; benchmarks/net_bench.py). Many more chunks would only add per-message overhead.
CHUNK_BYTES = 2 << 20


class PointToPoint(Protocol):
    """What a transfer uses of a gloo group: a torch ProcessGroup, or the round's
    TrackedGroup (worker/groups.py), which forwards to one."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> dist.Work: ...


@dataclass(frozen=True)
class Route:
    """Who sends and who receives one sync; the same on every rank."""

    root: int                 # sends the header (and chunks as senders[0])
    senders: tuple[int, ...]     # ranks that send chunks, root first
    receivers: tuple[int, ...]   # the chain, in order

    def source(self, chunk: int) -> int:
        return self.senders[chunk % len(self.senders)]

    def upstream(self, me: int, chunk: int) -> int:
        """Whom ``me`` (a receiver) receives ``chunk`` from."""
        i = self.receivers.index(me)
        return self.source(chunk) if i == 0 else self.receivers[i - 1]

    def downstream(self, me: int) -> int | None:
        """Whom ``me`` forwards to, or None at the chain's end."""
        i = self.receivers.index(me)
        return self.receivers[i + 1] if i + 1 < len(self.receivers) else None


def route(infos: Sequence[tuple[int, int, int]], max_senders: int) -> Route | None:
    """The Route for allgathered ``(version, ready, layout)`` per rank, or None when all agree.

    ``ready``: the rank's live tensors are unchanged since its commit and its snapshot
    buffers are intact, so it can send from the snapshot. ``layout``: a hash of the
    snapshot's layout, so that stripes from different senders fit together. Version -1
    (nothing committed anywhere): rank 0's live state goes to everyone.
    """
    versions = [v for v, _r, _l in infos]
    newest = max(versions)
    if newest < 0:
        return Route(0, (0,), tuple(range(1, len(infos)))) if len(infos) > 1 else None
    receivers = tuple(r for r, v in enumerate(versions) if v != newest)
    if not receivers:
        return None
    root = versions.index(newest)
    senders = [root]
    if infos[root][1]:
        senders += [r for r, (v, ready, layout) in enumerate(infos)
                    if r != root and v == newest and ready and layout == infos[root][2]]
    return Route(root, tuple(senders[:max(1, max_senders)]), receivers)


def chunks(flats: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """[(flat index, start byte, end byte)] covering every flat, in order."""
    out = []
    for i, flat in enumerate(flats):
        n = flat.numel() * flat.element_size()
        for start in range(0, n, CHUNK_BYTES):
            out.append((i, start, min(n, start + CHUNK_BYTES)))
    return out


def _piece(flats: Sequence[torch.Tensor], chunk: tuple[int, int, int]) -> torch.Tensor:
    i, start, end = chunk
    return flats[i].view(-1).view(torch.uint8)[start:end]


def _tag(c: int) -> int:
    return 1 + c      # tag 0 carries the header


def send_share(group: PointToPoint, flats: Sequence[torch.Tensor], rt: Route, me: int) -> int:
    """A sender: send its chunks to the chain's head; returns the bytes sent."""
    head = rt.receivers[0]
    works, sent = [], 0
    for c, chunk in enumerate(chunks(flats)):
        if rt.source(c) == me:
            piece = _piece(flats, chunk)
            works.append(group.send([piece], head, _tag(c)))
            sent += piece.numel()
    for work in works:
        work.wait()
    return sent


def receive_and_forward(group: PointToPoint, flats: Sequence[torch.Tensor], rt: Route,
                        me: int) -> tuple[int, int]:
    """A receiver: land every chunk in ``flats``, forwarding each once it has landed.

    Returns (bytes received, bytes forwarded).
    """
    plan = chunks(flats)
    recvs = [group.recv([_piece(flats, chunk)], rt.upstream(me, c), _tag(c))
             for c, chunk in enumerate(plan)]
    nxt = rt.downstream(me)
    sends, got, fwd = [], 0, 0
    for c, (chunk, work) in enumerate(zip(plan, recvs)):
        work.wait()
        piece = _piece(flats, chunk)
        got += piece.numel()
        if nxt is not None:
            sends.append(group.send([piece], nxt, _tag(c)))
            fwd += piece.numel()
    for work in sends:
        work.wait()
    return got, fwd


def relay_header(group: PointToPoint, header: bytes | None, rt: Route, me: int) -> bytes:
    """The header travels the chain too: root -> receivers[0] -> receivers[1] ...

    Returns the header bytes (on the root, the ones given).
    """
    if me == rt.root:
        assert header is not None, "the root sends the header it is given"
        _send_bytes(group, header, rt.receivers[0])
        return header
    i = rt.receivers.index(me)
    src = rt.root if i == 0 else rt.receivers[i - 1]
    length = torch.zeros(1, dtype=torch.int64)
    group.recv([length], src, 0).wait()
    data = torch.empty(int(length), dtype=torch.uint8)
    group.recv([data], src, 0).wait()
    header = data.numpy().tobytes()
    nxt = rt.downstream(me)
    if nxt is not None:
        _send_bytes(group, header, nxt)
    return header


def _send_bytes(group: PointToPoint, data: bytes, dst: int) -> None:
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    length = torch.tensor([body.numel()], dtype=torch.int64)
    group.send([length], dst, 0).wait()
    group.send([body], dst, 0).wait()
