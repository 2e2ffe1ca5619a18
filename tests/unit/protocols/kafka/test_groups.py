"""Unit tests of the group coordinator on a Clock and the fake metadata store."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from twisted.internet.task import Clock

sys.path.insert(0, str(Path(__file__).parents[2] / "broker_core"))

from fake_ledger import FakeMetadataStore, result_of

from polybroker.protocols.kafka import codec as c
from polybroker.protocols.kafka.groups import COMPLETING, EMPTY, PREPARING, STABLE, GroupCoordinator


def _join(g: GroupCoordinator, member: str = "", **kw: Any) -> Any:
    args: dict[str, Any] = {
        "client_id": "cl",
        "client_host": "/127.0.0.1",
        "session_timeout_ms": 10_000,
        "rebalance_timeout_ms": 30_000,
        "protocol_type": "consumer",
        "protocols": [("range", b"meta")],
        "require_known_member_id": True,
    }
    args.update(kw)
    return g.join("g", member, **args)


def _fired(d: Any) -> list[Any]:
    out: list[Any] = []
    d.addCallback(out.append)
    return out


def test_member_id_round_trip_then_a_lone_member_leads() -> None:
    """A join without an id gets MEMBER_ID_REQUIRED and an id; rejoining with it completes."""
    g = GroupCoordinator(Clock(), FakeMetadataStore())
    first = result_of(_join(g))
    assert first.error == c.MEMBER_ID_REQUIRED
    assert first.member_id.startswith("cl-")
    joined = result_of(_join(g, first.member_id))
    assert joined.error == c.NONE
    assert (joined.generation, joined.leader, joined.protocol) == (1, first.member_id, "range")
    assert joined.members == [(first.member_id, b"meta")]
    assert result_of(_join(g, "stranger")).error == c.UNKNOWN_MEMBER_ID


def test_second_member_triggers_a_rebalance_that_completes_when_both_rejoin() -> None:
    """The stable member learns of the rebalance by heartbeat, rejoins, and both get gen 2."""
    clock = Clock()
    g = GroupCoordinator(clock, FakeMetadataStore())
    a = result_of(_join(g, require_known_member_id=False)).member_id
    assert result_of(g.sync("g", 1, a, {a: b"all"})) == (c.NONE, b"all")
    assert g.groups["g"].state == STABLE
    b_join = _fired(_join(g, require_known_member_id=False))
    assert b_join == []
    assert g.groups["g"].state == PREPARING
    assert g.heartbeat("g", 1, a) == c.REBALANCE_IN_PROGRESS
    a_join = _fired(_join(g, a))
    assert a_join[0].generation == b_join[0].generation == 2
    assert g.groups["g"].state == COMPLETING
    b = b_join[0].member_id
    leader = a_join[0] if a_join[0].leader == a else b_join[0]
    assert len(leader.members) == 2
    b_sync = _fired(g.sync("g", 2, b, {}))
    assert b_sync == []
    assert result_of(g.sync("g", 2, a, {a: b"p0", b: b"p1"})) == (c.NONE, b"p0")
    assert b_sync == [(c.NONE, b"p1")]
    assert g.heartbeat("g", 2, b) == c.NONE
    assert g.heartbeat("g", 1, b) == c.ILLEGAL_GENERATION


def test_a_silent_member_expires_after_its_session_timeout() -> None:
    """Without heartbeats a member is removed after session.timeout; the group empties."""
    clock = Clock()
    g = GroupCoordinator(clock, FakeMetadataStore())
    a = result_of(_join(g, require_known_member_id=False)).member_id
    result_of(g.sync("g", 1, a, {}))
    clock.advance(9)
    assert g.heartbeat("g", 1, a) == c.NONE
    clock.advance(9)
    assert a in g.groups["g"].members
    clock.advance(2)
    assert g.groups["g"].members == {}
    assert g.groups["g"].state == EMPTY
    assert g.heartbeat("g", 1, a) == c.UNKNOWN_MEMBER_ID


def test_a_member_that_does_not_rejoin_is_dropped_at_the_rebalance_timeout() -> None:
    """The rebalance completes without a member that never rejoins."""
    clock = Clock()
    g = GroupCoordinator(clock, FakeMetadataStore())
    a = result_of(_join(g, require_known_member_id=False, session_timeout_ms=60_000)).member_id
    result_of(g.sync("g", 1, a, {}))
    b_join = _fired(_join(g, require_known_member_id=False, session_timeout_ms=60_000))
    clock.advance(31)
    assert b_join[0].error == c.NONE
    assert b_join[0].generation == 2
    assert list(g.groups["g"].members) == [b_join[0].member_id]


def test_leave_rebalances_the_others_and_inconsistent_protocols_are_refused() -> None:
    """LeaveGroup removes the member; a join with no common protocol is refused."""
    g = GroupCoordinator(Clock(), FakeMetadataStore())
    a = result_of(_join(g, require_known_member_id=False)).member_id
    odd = result_of(_join(g, require_known_member_id=False, protocols=[("sticky", b"")]))
    assert odd.error == c.INCONSISTENT_GROUP_PROTOCOL
    assert g.leave("g", a) == c.NONE
    assert g.groups["g"].state == EMPTY
    assert g.leave("g", a) == c.UNKNOWN_MEMBER_ID


def test_commits_are_durable_and_fenced_by_generation() -> None:
    """Commits land in the metadata store, survive a new coordinator, and a stale
    generation is refused; generation -1 commits from outside the group, which Kafka takes
    only while the group has no members."""
    store = FakeMetadataStore()
    mirrored: list[tuple[str, list[tuple[str, int, int]]]] = []
    g = GroupCoordinator(Clock(), store, on_commit=lambda *a: mirrored.append(a))
    a = result_of(_join(g, require_known_member_id=False)).member_id
    assert result_of(g.commit("g", 1, a, [("t", 0, 5, "m")])) == c.NONE
    assert result_of(g.commit("g", 0, a, [("t", 0, 9, "")])) == c.ILLEGAL_GENERATION
    assert result_of(g.commit("g", -1, "", [("t", 1, 3, "")])) == c.UNKNOWN_MEMBER_ID
    g.leave("g", a)
    assert result_of(g.commit("g", -1, "", [("t", 1, 3, "")])) == c.NONE
    assert mirrored == [("g", [("t", 0, 5)]), ("g", [("t", 1, 3)])]
    again = GroupCoordinator(Clock(), store)
    assert result_of(again.fetch_offsets("g")) == {("t", 0): (5, "m"), ("t", 1): (3, "")}
    assert result_of(g.delete("g")) == c.NONE
    assert result_of(GroupCoordinator(Clock(), store).fetch_offsets("g")) == {}


def test_groups_known_only_by_stored_commits_are_listed_after_a_restart() -> None:
    """A new coordinator lists a group that has committed offsets but no members, as Empty."""
    store = FakeMetadataStore()
    g = GroupCoordinator(Clock(), store)
    assert result_of(g.commit("with/slash", -1, "", [("t", 0, 1, "")])) == c.NONE
    again = GroupCoordinator(Clock(), store)
    listed = result_of(again.list_all())
    assert [(x.group_id, x.state) for x in listed] == [("with/slash", EMPTY)]


def test_odd_group_ids_are_stored_or_refused_cleanly() -> None:
    """'.', '..' and '/'-laden ids are stored; an empty or oversize id is INVALID_GROUP_ID."""
    store = FakeMetadataStore()
    g = GroupCoordinator(Clock(), store)
    for gid in (".", "..", "a/../b"):
        assert result_of(g.commit(gid, -1, "", [("t", 0, 4, "")])) == c.NONE
        assert result_of(GroupCoordinator(Clock(), store).fetch_offsets(gid)) == {("t", 0): (4, "")}
    assert result_of(g.commit("", -1, "", [("t", 0, 1, "")])) == c.INVALID_GROUP_ID
    assert result_of(g.commit("x" * 5000, -1, "", [("t", 0, 1, "")])) == c.INVALID_GROUP_ID
    assert result_of(g.fetch_offsets("x" * 5000)) == {}
