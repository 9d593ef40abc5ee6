"""The round's typed values (protocol.Member, RoundPlan, Assembled): their JSON is the
wire format, a round trip keeps every field, and a malformed value is one MessageError
(an ElasticError) naming what is wrong, never a KeyError or TypeError."""

import json

import pytest

from elastic.exceptions import ElasticError
from elastic.protocol import Assembled, Member, MessageError, RoundPlan
from elastic.runner.planner import Candidate, plan_round

MEMBER_JSON = {"worker_id": "12", "host": "node-2", "rank": 3, "size": 4, "local_rank": 1,
               "local_size": 2, "cross_rank": 1, "cross_size": 2}


def test_a_member_round_trips_through_its_json():
    member = Member.from_json(MEMBER_JSON)
    assert (member.worker_id, member.host, member.rank, member.cross_size) == ("12", "node-2", 3, 2)
    assert json.loads(json.dumps(member.to_json())) == MEMBER_JSON
    assert Member.from_json(json.loads(json.dumps(member.to_json()))) == member


def test_every_planned_member_round_trips():
    members = plan_round([Candidate(str(i), f"h{i % 3}", i // 3) for i in range(11)], ["h2"])
    assert [Member.from_json(json.loads(json.dumps(m.to_json()))) for m in members] == members


@pytest.mark.parametrize("change, says", [
    ({"rank": "3"}, "'rank'"),
    ({"rank": True}, "'rank'"),
    ({"rank": -1}, "'rank'"),
    ({"rank": 4}, "rank 4 is not below size 4"),
    ({"cross_rank": 2}, "cross_rank 2 is not below cross_size 2"),
    ({"host": None}, "'host'"),
    ({"worker_id": 12}, "'worker_id'"),
    ({"local_size": 1.5}, "'local_size'"),
])
def test_a_malformed_member_is_one_message_error(change, says):
    with pytest.raises(MessageError, match=says) as err:
        Member.from_json(dict(MEMBER_JSON, **change))
    assert isinstance(err.value, ElasticError)


@pytest.mark.parametrize("value", [None, [], "member", {k: v for k, v in MEMBER_JSON.items()
                                                       if k != "size"}])
def test_a_member_that_is_no_object_or_lacks_a_field_is_refused(value):
    with pytest.raises(MessageError, match="round member"):
        Member.from_json(value)


def test_a_round_plan_round_trips_and_knows_its_members():
    ids = ["0", "1", "2", "5", "6", "agent-x"]
    plan = RoundPlan.of(7, ids)
    wire = plan.to_json()
    assert wire == {"round": 7, "size": 6, "ids": [[0, 3], [5, 2], "agent-x"]}
    back = RoundPlan.from_json(json.loads(json.dumps(wire)))
    assert back == plan and back.member_ids() == ids
    assert all(back.contains(w) for w in ids)
    assert not any(back.contains(w) for w in ("3", "4", "7", "agent-y"))


@pytest.mark.parametrize("value, says", [
    ({"round": 1, "size": 2}, "'ids'"),
    ({"round": "1", "size": 2, "ids": []}, "'round'"),
    ({"round": 1, "size": 2, "ids": [[0]]}, "id entry"),
    ({"round": 1, "size": 2, "ids": [[0, "2"]]}, "id entry"),
    ({"round": 1, "size": 2, "ids": [3]}, "id entry"),
    (["round", 1], "JSON object"),
])
def test_a_malformed_round_plan_is_one_message_error(value, says):
    with pytest.raises(MessageError, match=says):
        RoundPlan.from_json(value)


def test_the_assembly_word_round_trips_and_refuses_a_non_bool():
    for ok in (True, False):
        word = Assembled(3, ok)
        assert word.to_json() == {"round": 3, "ok": ok}
        assert Assembled.from_json(json.loads(json.dumps(word.to_json()))) == word
    with pytest.raises(MessageError, match="'ok'"):
        Assembled.from_json({"round": 3, "ok": 1})
