"""matching.decide: what a set does with one exchange of op records (a pure function).

The same records give the same decision on every member, which is what keeps
ranks that issue named async ops in different orders in step. The real
exchanges run in tests/test_hvd_ops.py (hvd_fidelity_checks.py).
"""

import torch

from elastic.torch import matching, negotiation
from elastic.torch.matching import BLOCKING, DEFER, DEFERRABLE, FLUSH, MISMATCH, RUN, WAITING


def key(name, what="allreduce"):
    return matching.op_key(what, negotiation.record(negotiation.ALLREDUCE, name=name))


def rec(name=None, mode=BLOCKING, pending=(), kind=negotiation.ALLREDUCE):
    r = negotiation.record(kind, [torch.ones(2)], name=name)
    r[negotiation.MODE] = mode
    r[negotiation.KEY] = key(name) if name else 0
    r[negotiation.NPEND] = len(pending)
    r[negotiation.PEND:negotiation.PEND + len(pending)] = [key(p) for p in pending]
    return r


def test_the_same_op_everywhere_runs_in_one_exchange():
    assert matching.decide([rec(), rec()]) == (RUN, None)
    assert matching.decide([rec("a", DEFERRABLE), rec("a", DEFERRABLE)]) == (RUN, None)
    # pending ops elsewhere do not hold up an op every rank agrees on
    assert matching.decide([rec("s", pending=["x"]), rec("s")]) == (RUN, None)


def test_a_named_async_op_waits_for_peers_that_issue_it_later():
    assert matching.decide([rec("dup", DEFERRABLE), rec("sync1"), rec("sync1")]) == (DEFER, None)
    # later the peers issue it while rank 0 is in the next collective: it runs first
    assert matching.decide([rec("sync2", pending=["dup"]), rec("dup", DEFERRABLE),
                            rec("dup", DEFERRABLE)]) == (FLUSH, [key("dup")])


def test_ops_issued_in_different_orders_run_in_the_lowest_ranks_order():
    first = [rec("a", DEFERRABLE), rec("b", DEFERRABLE)]
    assert matching.decide(first) == (DEFER, None)
    second = [rec("b", DEFERRABLE, pending=["a"]), rec("a", DEFERRABLE, pending=["b"])]
    assert matching.decide(second) == (FLUSH, [key("a"), key("b")])
    assert matching.decide(list(reversed(second))) == (FLUSH, [key("b"), key("a")])


def test_waits_run_the_op_when_every_rank_has_it():
    assert matching.decide([rec("a", WAITING, pending=["a"]), rec("x", pending=["a"])]) == \
        (FLUSH, [key("a")])
    assert matching.decide([rec("a", WAITING, pending=["a"]), rec("a")]) == (FLUSH, [key("a")])


def test_what_cannot_wait_is_a_mismatch_not_a_hang():
    assert matching.decide([rec("a", WAITING, pending=["a"]), rec("other")]) == (MISMATCH, None)
    assert matching.decide([rec("a"), rec("b")]) == (MISMATCH, None)
    assert matching.decide([rec(), rec("b")]) == (MISMATCH, None)


def test_the_kind_is_part_of_the_key():
    assert key("x", "allreduce") != key("x", "allgather") and key(None) == 0


def test_join_keeps_the_ordered_rules():
    joined = negotiation.record(negotiation.JOIN)
    assert matching.decide([joined, rec("a", DEFERRABLE), rec("b")]) == (RUN, None)
