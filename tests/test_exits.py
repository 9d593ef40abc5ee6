"""Truth table of elastic/runner/exits.py: what one worker exit means, and the job's outcome."""

import itertools

import pytest

from elastic.runner.exits import ExitKind, classify_exit, final_outcome

F, R, X, S = ExitKind.FINISHED, ExitKind.REMOVED, ExitKind.FAILED, ExitKind.STOPPED


def expected_kind(code, stopped, in_round, done):
    """The rules, written independently of the implementation."""
    if stopped:
        return S           # the driver killed it on purpose: never a failure
    if code != 0:
        return X           # any non-zero exit (signals included) is a failure
    if done or in_round:
        return F           # reported done, or a plain script ending in its round
    return R               # left without finishing: removed (a past member or never one)


CODES = [0, 1, 2, 137, -9, -15]
TABLE = list(itertools.product(CODES, [False, True], [False, True], [False, True]))


@pytest.mark.parametrize("code,stopped,in_round,done", TABLE)
def test_classify_exit_truth_table(code, stopped, in_round, done):
    got = classify_exit(code, stopped_by_driver=stopped, in_current_round=in_round,
                        reported_done=done)
    assert got is expected_kind(code, stopped, in_round, done)


@pytest.mark.parametrize("kwargs,kind", [
    # The named situations from the design, spelled out.
    # trained to the end
    (dict(code=0, stopped_by_driver=False, in_current_round=True, reported_done=True), F),
    # plain script exits 0 in its round
    (dict(code=0, stopped_by_driver=False, in_current_round=True, reported_done=False), F),
    # not in the new plan: exits 0
    (dict(code=0, stopped_by_driver=False, in_current_round=False, reported_done=False), R),
    # exited before joining any round
    (dict(code=0, stopped_by_driver=False, in_current_round=False, reported_done=False), R),
    # reported done but then crashed
    (dict(code=1, stopped_by_driver=False, in_current_round=True, reported_done=True), X),
    # crashed at import
    (dict(code=1, stopped_by_driver=False, in_current_round=False, reported_done=False), X),
    # evicted by the driver
    (dict(code=-9, stopped_by_driver=True, in_current_round=True, reported_done=False), S),
    # SIGKILLed by someone else
    (dict(code=-9, stopped_by_driver=False, in_current_round=True, reported_done=False), X),
    # stop wins even over a clean exit
    (dict(code=0, stopped_by_driver=True, in_current_round=False, reported_done=True), S),
])
def test_classify_exit_named_cases(kwargs, kind):
    code = kwargs.pop("code")
    assert classify_exit(code, **kwargs) is kind


def test_classify_exit_flags_are_keyword_only():
    with pytest.raises(TypeError):
        classify_exit(0, False, True, True)


def test_exit_kind_values():
    assert {k.value for k in ExitKind} == {"finished", "removed", "failed", "stopped"}


@pytest.mark.parametrize("codes,ok,failed", [
    ({"0": 0}, True, {}),
    ({"0": 0, "1": 0, "2": 0}, True, {}),
    ({"0": 1}, False, {"0": 1}),
    ({"0": 0, "1": 3}, False, {"1": 3}),
    ({"0": -9, "1": 0, "2": 2}, False, {"0": -9, "2": 2}),
    ({"0": 137, "1": 1}, False, {"0": 137, "1": 1}),
    ({}, True, {}),                    # vacuous: the driver decides whether a round existed
])
def test_final_outcome(codes, ok, failed):
    assert final_outcome(codes) == (ok, failed)


def test_final_outcome_does_not_mutate_its_input():
    codes = {"0": 0, "1": 1}
    final_outcome(codes)
    assert codes == {"0": 0, "1": 1}


def test_plain_script_that_never_joined_finishes():
    kind = classify_exit(0, stopped_by_driver=False, in_current_round=False, reported_done=False,
                         never_joined=True)
    assert kind is ExitKind.FINISHED
    assert classify_exit(1, stopped_by_driver=False, in_current_round=False, reported_done=False,
                         never_joined=True) is ExitKind.FAILED
