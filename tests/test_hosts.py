import math
import random

import pytest

from elastic.runner.hosts import HostChanges, HostManager


def test_update_reports_changes():
    m = HostManager()
    c = m.update({"a": 2, "b": 1}, now=0)
    assert c == HostChanges(added=("a", "b"))
    assert c

    c = m.update({"a": 4, "b": 1, "c": 1}, now=1)
    assert c == HostChanges(added=("c",), changed=("a",))

    c = m.update({"c": 1, "a": 4}, now=2)
    assert c == HostChanges(removed=("b",))

    c = m.update({"a": 4, "c": 1}, now=3)
    assert c == HostChanges()
    assert not c


def test_order_is_first_seen():
    m = HostManager()
    m.update({"b": 1, "a": 1}, now=0)
    m.update({"c": 1, "a": 1, "b": 1}, now=1)
    assert list(m.available(1)) == ["b", "a", "c"]
    # A host that disappears and comes back keeps its original position.
    m.update({"c": 1, "a": 1}, now=2)
    m.update({"a": 1, "c": 1, "b": 3}, now=3)
    assert list(m.available(3)) == ["b", "a", "c"]
    assert m.available(3) == {"b": 3, "a": 1, "c": 1}
    assert list(m.discovered()) == ["b", "a", "c"]


def test_update_rejects_bad_slots():
    with pytest.raises(ValueError):
        HostManager().update({"a": 0}, now=0)


def test_update_copies_input():
    m = HostManager()
    hosts = {"a": 1}
    m.update(hosts, now=0)
    hosts["b"] = 1
    assert m.available(0) == {"a": 1}


def test_permanent_blacklist():
    m = HostManager()
    m.update({"a": 1, "b": 2}, now=0)
    assert m.blacklist("a", now=1) == math.inf
    assert m.is_blacklisted("a", 1)
    assert m.is_blacklisted("a", 1e12)
    assert m.available(1e12) == {"b": 2}
    assert m.blacklisted(5) == ("a",)
    assert m.next_return_time() is None
    assert m.returning(1e12) == ()
    # The next update reports the blacklisted host as removed.
    assert m.update({"a": 1, "b": 2}, now=2) == HostChanges(removed=("a",))


def test_cooldown_grows_and_caps():
    m = HostManager(cooldown_range=(10, 35))
    m.update({"a": 1}, now=0)
    expected_delays = [10, 20, 35, 35]
    now = 0.0
    for i, delay in enumerate(expected_delays, 1):
        until = m.blacklist("a", now)
        assert until == now + delay
        assert m.failures("a") == i
        assert m.is_blacklisted("a", now + delay - 0.001)
        assert not m.is_blacklisted("a", now + delay)
        assert m.next_return_time() == now + delay
        now += delay
        assert m.returning(now) == ("a",)


def test_blacklisting_a_barred_host_counts_once():
    m = HostManager(cooldown_range=(10, 100))
    m.update({"a": 1}, now=0)
    assert m.blacklist("a", 0) == 10
    assert m.blacklist("a", 5) == 10
    assert m.failures("a") == 1


def test_zero_min_cooldown_returns_immediately():
    m = HostManager(cooldown_range=(0, 0))
    m.update({"a": 1}, now=0)
    m.blacklist("a", 0)
    assert not m.is_blacklisted("a", 0)


def test_jitter_within_bounds():
    m = HostManager(cooldown_range=(10, 100), rng=random.Random(1))
    m.update({"a": 1}, now=0)
    now = 0.0
    for delay in [10, 20, 40, 80, 100, 100]:
        until = m.blacklist("a", now)
        assert delay <= until - now <= min(100, delay * 1.5)
        now = until


def test_jitter_is_reproducible():
    def run(seed):
        m = HostManager(cooldown_range=(1, 60), rng=random.Random(seed))
        return [m.blacklist(h, 0) for h in "abc"]
    assert run(7) == run(7)
    assert len(set(run(7))) == 3


def test_returning_reports_once_and_in_order():
    m = HostManager(cooldown_range=(10, 10))
    m.update({"a": 1, "b": 1, "c": 1}, now=0)
    m.blacklist("c", 0)
    m.blacklist("a", 1)
    assert m.returning(5) == ()
    assert m.returning(20) == ("a", "c")
    assert m.returning(21) == ()
    assert m.update({"a": 1, "b": 1, "c": 1}, now=21) == HostChanges()


def test_returning_and_update_after_cooldown():
    m = HostManager(cooldown_range=(10, 10))
    m.update({"a": 1, "b": 1}, now=0)
    m.blacklist("a", 0)
    assert m.update({"a": 1, "b": 1}, now=1) == HostChanges(removed=("a",))
    assert m.update({"a": 1, "b": 1}, now=11) == HostChanges(added=("a",))
    assert list(m.available(11)) == ["a", "b"]


def test_returning_skips_undiscovered_hosts():
    m = HostManager(cooldown_range=(10, 10))
    m.update({"a": 1, "b": 1}, now=0)
    m.blacklist("a", 0)
    m.update({"b": 1}, now=1)
    assert m.returning(20) == ()


def test_all_blacklisted():
    m = HostManager(cooldown_range=(10, 10))
    assert not m.all_blacklisted(0)  # nothing discovered yet
    m.update({"a": 1, "b": 1}, now=0)
    assert not m.all_blacklisted(0)
    m.blacklist("a", 0)
    assert not m.all_blacklisted(0)
    m.blacklist("b", 2)
    assert m.all_blacklisted(5)
    assert m.next_return_time() == 10
    assert not m.all_blacklisted(10)
    # Undiscovered hosts do not count.
    m.blacklist("a", 20)
    m.update({"a": 1}, now=20)
    assert m.all_blacklisted(20)
    m.update({}, now=21)
    assert not m.all_blacklisted(21)


def test_next_return_time_ignores_expired_with_now():
    m = HostManager(cooldown_range=(10, 40))
    m.update({"a": 1, "b": 1}, now=0)
    m.blacklist("a", 0)   # back at 10
    m.blacklist("b", 5)   # back at 15
    assert m.next_return_time() == 10
    assert m.next_return_time(now=12) == 15
    assert m.next_return_time(now=30) is None


def test_blacklist_undiscovered_host():
    m = HostManager()
    m.blacklist("x", 0)
    assert m.blacklisted(0) == ("x",)
    assert m.update({"x": 1, "y": 1}, now=1) == HostChanges(added=("y",))
    assert list(m.available(1)) == ["y"]


@pytest.mark.parametrize("bad", [(-1, 5), (5, 1), (0, math.inf)])
def test_bad_cooldown_range(bad):
    with pytest.raises(ValueError):
        HostManager(cooldown_range=bad)


def test_copy_is_independent_and_reads_the_same():
    m = HostManager(cooldown_range=(10, 100), rng=random.Random(3))
    m.update({"b": 1, "a": 2, "c": 1}, now=0)
    m.blacklist("c", now=0)
    c = m.copy()
    assert (c.discovered(), c.available(1), c.blacklisted(1), c.failures("c")) == \
        (m.discovered(), m.available(1), m.blacklisted(1), m.failures("c"))
    c_until = c.blacklist("a", now=1)                  # draws from the copy's own rng
    c.update({"d": 1}, now=2)
    assert m.discovered() == {"b": 1, "a": 2, "c": 1} and not m.is_blacklisted("a", 1)
    assert m.failures("a") == 0
    assert m.blacklist("a", now=1) == c_until          # the original's rng did not move


def test_version_moves_exactly_when_a_read_may_change():
    m = HostManager(cooldown_range=(10, 10))
    v = m.version
    m.update({"a": 1, "b": 1}, now=0)
    assert m.version > v
    v = m.version
    m.update({"b": 1, "a": 1}, now=1)                 # same hosts, another order: no change
    m.returning(1)
    assert m.version == v
    m.blacklist("a", now=1)
    assert m.version > v
    v = m.version
    m.blacklist("a", now=2)                            # already barred: nothing new
    m.returning(5)
    assert m.version == v
    assert m.returning(11) == ("a",) and m.version > v  # the cooldown ran out
    v = m.version
    m.update({"a": 2, "b": 1}, now=12)
    assert m.version > v


def test_the_same_result_again_reports_what_a_model_of_the_rules_reports():
    """update skips its O(n) work when the result repeats; a random walk of results,
    blacklistings, returns and clock steps checks it against the rules themselves."""
    rng = random.Random(7)
    pool = [f"h{i}" for i in range(8)]
    for _ in range(50):
        m = HostManager(cooldown_range=(1.0, 4.0))
        now, result, barred, seen, before = 0.0, {}, {}, [], {}
        for _ in range(60):
            op = rng.random()
            now += rng.choice([0.0, 0.3, 1.0, 2.5])
            if op < 0.3:                                 # a new result
                result = {h: rng.randint(1, 3) for h in rng.sample(pool, rng.randint(0, 8))}
            elif op < 0.45 and result:                   # a failure bars a host
                host = rng.choice(sorted(result))
                barred[host] = m.blacklist(host, now)
            elif op < 0.55:
                for host in m.returning(now):
                    assert barred[host] <= now
            seen += [h for h in result if h not in seen]
            available = {h: result[h] for h in seen
                         if h in result and barred.get(h, -math.inf) <= now}
            changes = m.update(dict(result), now)      # often the very same result again
            assert m.available(now) == available
            assert changes == HostChanges(
                added=tuple(h for h in available if h not in before),
                removed=tuple(h for h in seen if h in before and h not in available),
                changed=tuple(h for h in available if h in before and before[h] != available[h]))
            before = available
