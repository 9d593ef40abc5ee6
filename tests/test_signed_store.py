"""The rendezvous store gloo receives: real gloo groups over a real TCPStore,
with an outsider's writes in the middle."""

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.harness import free_port

from elastic import protocol as control
from elastic.protocol import ControlStore
from elastic.worker.signed_store import SignedStore

SCOPE = "pg/3/"


@pytest.fixture
def master():
    store = control.connect("127.0.0.1", free_port(), 30, is_master=True)
    yield store
    del store


def client(master, secret="s3cret"):
    conn = control.connect("127.0.0.1", master.port, 30)
    return ControlStore(conn, secret, warn=lambda _msg: None)


def build_groups(master, n, before_wait=None):
    """n gloo ranks (threads), each on its own connection and SignedStore; the
    allreduce results, and the SignedStores."""
    stores = [SignedStore(client(master), SCOPE, 60) for _ in range(n)]
    results, errors = [None] * n, []

    def rank(r):
        try:
            if before_wait and r == 0:
                before_wait()
            pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", stores[r]), r, n,
                                       timedelta(seconds=60))
            t = torch.full((2,), float(r + 1))
            pg.allreduce([t]).wait()
            results[r] = t.tolist()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def watch():
        # As the runtime's abort watch does while a group forms (its allreduce check
        # included): peers may still need our rendezvous values.
        while any(t.is_alive() for t in threads):
            for store in stores:
                store.heal()
            time.sleep(0.05)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.join(120)
    watcher.join(10)
    assert not errors, errors
    return results, stores


def test_gloo_forms_a_group_through_the_signed_store(master):
    results, _ = build_groups(master, 3)
    assert results == [[6.0, 6.0]] * 3
    # What sits in the store is sealed: a MAC, a sequence number, then gloo's bytes.
    raw = client(master).raw
    for r in range(3):
        blob = bytes(raw.get(f"{SCOPE}gloo//0/{r}"))
        assert blob[64:65] == b"." and blob.split(b".", 2)[1].isdigit()


def test_forged_peer_addresses_are_ignored_and_overwritten_values_come_back(master):
    """An outsider plants a fake address for rank 1 before the round, and overwrites
    rank 0's real one after rank 0 wrote it: the group still forms, among the real ranks."""
    ns = client(master).raw     # the job's namespace, as an outsider sees it with list_keys()
    ns.set(SCOPE + "gloo//0/1", b"\x00" * 64 + b".1.fake-address")
    overwritten = []

    def overwrite_rank0_later():
        def later():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not ns.check([SCOPE + "gloo//0/0"]):
                time.sleep(0.001)
            ns.set(SCOPE + "gloo//0/0", b"garbage")
            overwritten.append(True)
        threading.Thread(target=later, daemon=True).start()

    results, stores = build_groups(master, 2, before_wait=overwrite_rank0_later)
    assert results == [[3.0, 3.0]] * 2
    assert overwritten


def test_a_value_sealed_for_another_round_does_not_verify(master):
    cs = client(master)
    round3, round4 = SignedStore(cs, "pg/3/", 5), SignedStore(cs, "pg/4/", 1)
    round3.set("gloo//0/0", b"addr")
    assert round3.get("gloo//0/0") == b"addr"
    cs.raw.set("pg/4/gloo//0/0", bytes(cs.raw.get("pg/3/gloo//0/0")))   # replay in round 4
    assert not round4.check(["gloo//0/0"])
    with pytest.raises(Exception, match="valid seal"):
        round4.wait(["gloo//0/0"], timedelta(seconds=0.3))


def test_the_rendezvous_store_has_no_counters(master):
    with pytest.raises(RuntimeError, match="no counters"):
        SignedStore(client(master), SCOPE, 5).add("x", 1)
