"""The Kafka group coordinator: membership, rebalances and committed offsets.

The classic group protocol, as Kafka's coordinator runs it for one broker:

* JoinGroup: a member without an id gets one back with MEMBER_ID_REQUIRED (v4+) and joins again
  with it. A join moves the group to PreparingRebalance; the rebalance completes when every
  known member has joined again, or when the longest rebalance timeout passes (members that did
  not rejoin are dropped). Then the generation grows, one protocol all members support is chosen,
  the leader gets every member's metadata and all joins are answered.
* SyncGroup: the leader sends the assignments; every member gets its own. Heartbeats during a
  rebalance answer REBALANCE_IN_PROGRESS, which makes members join again.
* A member silent for its session timeout is removed (timers on the injected clock).
* Committed offsets are kept per group in the metadata store at ``/kafka/groups/<group>``
  (written before the commit is acknowledged) and cached in memory; ``on_commit`` is told of
  each durable commit, once with all its partitions (the handler mirrors it on a Pulsar
  subscription named after the group).
  A group's commits are written one at a time, in arrival order, by compare-and-set against
  the version last read or written: a copy cached here never overwrites commits another
  broker made meanwhile (the document is read again and the commit applied on top). With
  ``fresh_offsets`` (a cluster, where coordination moves between brokers) OffsetFetch reads
  the store every time, and ``is_coordinator(group)`` is asked before each write: a broker
  that lost the group never writes again, so once the new coordinator wrote, the old one's
  compare-and-set fails and it answers NOT_COORDINATOR. ``forget`` drops what this broker
  holds of a group it no longer coordinates; waiting joins and syncs are answered
  NOT_COORDINATOR.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from twisted.internet.defer import Deferred, DeferredLock, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from polybroker.logs import kv
from polybroker.metadata.api import BadVersionError
from polybroker.protocols.kafka import codec as c

log = logging.getLogger(__name__)

GROUPS_ROOT = "/kafka/groups"
EMPTY = "Empty"
PREPARING = "PreparingRebalance"
COMPLETING = "CompletingRebalance"
STABLE = "Stable"
DEAD = "Dead"
#: Compare-and-set attempts of one commit before it is refused as NOT_COORDINATOR.
_COMMIT_ATTEMPTS = 8


@dataclass
class JoinResult:
    error: int
    generation: int = -1
    protocol: str | None = None
    leader: str = ""
    member_id: str = ""
    members: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass
class Member:
    member_id: str
    client_id: str
    client_host: str
    session_timeout_ms: int
    rebalance_timeout_ms: int
    protocol_type: str
    protocols: list[tuple[str, bytes]]
    assignment: bytes = b""
    join: Deferred[JoinResult] | None = None
    sync: Deferred[tuple[int, bytes]] | None = None
    expiry: IDelayedCall | None = None


@dataclass
class Group:
    group_id: str
    state: str = EMPTY
    generation: int = 0
    protocol_type: str | None = None
    protocol: str | None = None
    leader: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)
    rebalance_timer: IDelayedCall | None = None
    offsets: dict[tuple[str, int], tuple[int, str]] | None = None
    version: int = -1  # of the stored offsets document when last read or written (-1: none)
    writes: DeferredLock = field(default_factory=DeferredLock)


#: Told of each durable commit: (group id, [(topic, partition, offset)]).
OnCommit = Callable[[str, list[tuple[str, int, int]]], None]


class GroupCoordinator:
    """Every consumer group of this broker (see the module docstring)."""

    def __init__(
        self,
        clock: IReactorTime,
        store: Any,
        *,
        min_session_timeout_ms: int = 6000,
        max_session_timeout_ms: int = 1_800_000,
        on_commit: OnCommit | None = None,
        fresh_offsets: bool = False,
        is_coordinator: Callable[[str], bool] | None = None,
    ) -> None:
        self.clock = clock
        self.store = store  # a MetadataStore
        self.fresh_offsets = fresh_offsets
        self.is_coordinator = is_coordinator
        self.min_session_timeout_ms = min_session_timeout_ms
        self.max_session_timeout_ms = max_session_timeout_ms
        self.on_commit = on_commit
        self.groups: dict[str, Group] = {}

    def _group(self, group_id: str) -> Group:
        g = self.groups.get(group_id)
        if g is None:
            g = self.groups[group_id] = Group(group_id)
        return g

    # -- membership -----------------------------------------------------------------------

    def join(
        self,
        group_id: str,
        member_id: str,
        *,
        client_id: str,
        client_host: str,
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
        protocol_type: str,
        protocols: list[tuple[str, bytes]],
        require_known_member_id: bool,
    ) -> Deferred[JoinResult]:
        """JoinGroup; fires when the rebalance completes (or at once with an error)."""
        if not group_id:
            return succeed(JoinResult(c.INVALID_GROUP_ID, member_id=member_id))
        if not (self.min_session_timeout_ms <= session_timeout_ms <= self.max_session_timeout_ms):
            return succeed(JoinResult(c.INVALID_SESSION_TIMEOUT, member_id=member_id))
        g = self._group(group_id)
        if g.state == DEAD:
            return succeed(JoinResult(c.COORDINATOR_NOT_AVAILABLE, member_id=member_id))
        if not protocols or (
            g.members and g.protocol_type is not None and protocol_type != g.protocol_type
        ):
            return succeed(JoinResult(c.INCONSISTENT_GROUP_PROTOCOL, member_id=member_id))
        if g.members and not self._common_protocols(g, protocols, exclude=member_id):
            return succeed(JoinResult(c.INCONSISTENT_GROUP_PROTOCOL, member_id=member_id))
        if not member_id:
            new_id = f"{client_id or 'member'}-{uuid.uuid4()}"
            if require_known_member_id:
                g.pending.add(new_id)
                return succeed(JoinResult(c.MEMBER_ID_REQUIRED, member_id=new_id))
            member_id = new_id
        elif member_id not in g.members and member_id not in g.pending:
            return succeed(JoinResult(c.UNKNOWN_MEMBER_ID, member_id=member_id))
        g.pending.discard(member_id)
        m = g.members.get(member_id)
        if m is None:
            m = Member(
                member_id,
                client_id,
                client_host,
                session_timeout_ms,
                rebalance_timeout_ms,
                protocol_type,
                protocols,
            )
            g.members[member_id] = m
        else:
            m.session_timeout_ms = session_timeout_ms
            m.rebalance_timeout_ms = rebalance_timeout_ms
            m.protocols = protocols
            if m.join is not None:  # a repeated join replaces the waiting one
                old, m.join = m.join, None
                old.callback(JoinResult(c.UNKNOWN_MEMBER_ID, member_id=member_id))
        g.protocol_type = protocol_type
        d: Deferred[JoinResult] = Deferred()
        m.join = d
        self._touch(g, m)
        if g.state != PREPARING:
            self._prepare_rebalance(g)
        self._maybe_complete_join(g)
        return d

    def _common_protocols(
        self, g: Group, protocols: list[tuple[str, bytes]], exclude: str = ""
    ) -> list[str]:
        names = [p for p, _ in protocols]
        for mid, m in g.members.items():
            if mid == exclude:
                continue
            theirs = {p for p, _ in m.protocols}
            names = [p for p in names if p in theirs]
        return names

    def _prepare_rebalance(self, g: Group) -> None:
        g.state = PREPARING
        for m in g.members.values():
            if m.sync is not None:
                s, m.sync = m.sync, None
                s.callback((c.REBALANCE_IN_PROGRESS, b""))
        timeout_s = max((m.rebalance_timeout_ms for m in g.members.values()), default=0) / 1000
        if g.rebalance_timer is not None and g.rebalance_timer.active():
            g.rebalance_timer.cancel()
        g.rebalance_timer = self.clock.callLater(timeout_s, self._rebalance_timeout, g)

    def _rebalance_timeout(self, g: Group) -> None:
        g.rebalance_timer = None
        if g.state != PREPARING:
            return
        for mid, m in list(g.members.items()):
            if m.join is None:
                self._remove(g, mid, rebalance=False)
        self._complete_join(g)

    def _maybe_complete_join(self, g: Group) -> None:
        if g.state == PREPARING and all(m.join is not None for m in g.members.values()):
            self._complete_join(g)

    def _complete_join(self, g: Group) -> None:
        if g.rebalance_timer is not None and g.rebalance_timer.active():
            g.rebalance_timer.cancel()
        g.rebalance_timer = None
        if not g.members:
            g.state = EMPTY
            g.generation += 1
            g.leader = None
            g.protocol = None
            return
        g.generation += 1
        first = next(iter(g.members.values()))
        candidates = self._common_protocols(g, first.protocols)
        g.protocol = candidates[0] if candidates else first.protocols[0][0]
        if g.leader not in g.members:
            g.leader = first.member_id
        g.state = COMPLETING
        log.info(
            "group rebalanced",
            extra=kv(group=g.group_id, generation=g.generation, members=len(g.members)),
        )
        everyone = [(mid, dict(m.protocols).get(g.protocol, b"")) for mid, m in g.members.items()]
        for mid, m in list(g.members.items()):
            m.assignment = b""
            d, m.join = m.join, None
            if d is not None:
                d.callback(
                    JoinResult(
                        c.NONE,
                        g.generation,
                        g.protocol,
                        g.leader or "",
                        mid,
                        everyone if mid == g.leader else [],
                    )
                )
            self._touch(g, m)

    def sync(
        self, group_id: str, generation: int, member_id: str, assignments: dict[str, bytes]
    ) -> Deferred[tuple[int, bytes]]:
        """SyncGroup; fires with (error, this member's assignment)."""
        g = self.groups.get(group_id)
        if g is None or member_id not in g.members:
            return succeed((c.UNKNOWN_MEMBER_ID, b""))
        if generation != g.generation:
            return succeed((c.ILLEGAL_GENERATION, b""))
        m = g.members[member_id]
        self._touch(g, m)
        if g.state == PREPARING:
            return succeed((c.REBALANCE_IN_PROGRESS, b""))
        if g.state == STABLE:
            return succeed((c.NONE, m.assignment))
        d: Deferred[tuple[int, bytes]] = Deferred()
        m.sync = d
        if member_id == g.leader:
            for mid, other in g.members.items():
                other.assignment = assignments.get(mid, b"")
            g.state = STABLE
            log.info("group stable", extra=kv(group=g.group_id, generation=g.generation))
            for other in g.members.values():
                if other.sync is not None:
                    s, other.sync = other.sync, None
                    s.callback((c.NONE, other.assignment))
        return d

    def heartbeat(self, group_id: str, generation: int, member_id: str) -> int:
        """Heartbeat; the error code."""
        g = self.groups.get(group_id)
        if g is None or member_id not in g.members:
            return c.UNKNOWN_MEMBER_ID
        self._touch(g, g.members[member_id])
        if g.state == PREPARING:
            return c.REBALANCE_IN_PROGRESS
        if generation != g.generation:
            return c.ILLEGAL_GENERATION
        return c.NONE

    def leave(self, group_id: str, member_id: str) -> int:
        """LeaveGroup of one member; the error code."""
        g = self.groups.get(group_id)
        if g is None or member_id not in g.members:
            return c.UNKNOWN_MEMBER_ID
        self._remove(g, member_id, rebalance=True)
        return c.NONE

    def _touch(self, g: Group, m: Member) -> None:
        if m.expiry is not None and m.expiry.active():
            m.expiry.cancel()
        m.expiry = self.clock.callLater(m.session_timeout_ms / 1000, self._expire, g, m)

    def _expire(self, g: Group, m: Member) -> None:
        m.expiry = None
        if g.members.get(m.member_id) is not m:
            return
        if m.join is not None:  # waiting in a rebalance: the rebalance timeout decides
            return
        log.info("group member expired", extra=kv(group=g.group_id, member=m.member_id))
        self._remove(g, m.member_id, rebalance=True)

    def _remove(self, g: Group, member_id: str, *, rebalance: bool) -> None:
        m = g.members.pop(member_id, None)
        if m is None:
            return
        if m.expiry is not None and m.expiry.active():
            m.expiry.cancel()
        if m.join is not None:
            d, m.join = m.join, None
            d.callback(JoinResult(c.UNKNOWN_MEMBER_ID, member_id=member_id))
        if m.sync is not None:
            s, m.sync = m.sync, None
            s.callback((c.UNKNOWN_MEMBER_ID, b""))
        if not rebalance:
            return
        if not g.members:
            if g.rebalance_timer is not None and g.rebalance_timer.active():
                g.rebalance_timer.cancel()
            g.rebalance_timer = None
            g.state = EMPTY
            g.generation += 1
            g.leader = None
            g.protocol = None
        elif g.state == PREPARING:
            self._maybe_complete_join(g)
        else:
            self._prepare_rebalance(g)

    # -- listing --------------------------------------------------------------------------

    def describe(self, group_id: str) -> Group | None:
        return self.groups.get(group_id)

    def list(self) -> list[Group]:
        """The live groups of this broker (``list_all`` adds those known only by commits)."""
        return [g for g in self.groups.values() if g.state != DEAD]

    def list_all(self) -> Deferred[list[Group]]:
        """Live groups and, as Empty, groups that only have committed offsets stored."""
        return Deferred.fromCoroutine(self._list_all())

    async def _list_all(self) -> list[Group]:
        stored = await self.store.children(GROUPS_ROOT)
        for name in stored:
            if name.startswith("g-"):
                self._group(unquote(name[2:]))
        return self.list()

    async def stored_commits(self) -> list[tuple[str, list[tuple[str, int, int]]]]:
        """(group id, [(topic, partition, offset)]) of every group with offsets stored, read
        from the metadata store whichever broker coordinates it (unreadable ones are skipped)."""
        out: list[tuple[str, list[tuple[str, int, int]]]] = []
        for name in await self.store.children(GROUPS_ROOT):
            if not name.startswith("g-"):
                continue
            found = await self.store.get(f"{GROUPS_ROOT}/{name}")
            if found is None:
                continue
            try:
                items = json.loads(found.value)["offsets"]
                offsets = [(str(i[0]), int(i[1]), int(i[2])) for i in items]
            except (ValueError, KeyError, TypeError, IndexError):
                continue
            out.append((unquote(name[2:]), offsets))
        return out

    def delete(self, group_id: str) -> Deferred[int]:
        """DeleteGroups of one group: refused while it has members."""
        g = self.groups.get(group_id)
        if g is not None and g.members:
            return succeed(c.NON_EMPTY_GROUP)
        return Deferred.fromCoroutine(self._delete(group_id))

    async def _delete(self, group_id: str) -> int:
        found = await self.store.get(self._path(group_id))
        g = self.groups.pop(group_id, None)
        if found is None and (g is None or not g.offsets):
            return c.GROUP_ID_NOT_FOUND
        if found is not None:
            await self.store.delete(self._path(group_id))
        return c.NONE

    # -- offsets --------------------------------------------------------------------------

    def _path(self, group_id: str) -> str:
        # The prefix keeps "", "." and ".." valid node names; quoting keeps "/" inside one.
        return f"{GROUPS_ROOT}/g-{quote(group_id, safe='')}"

    async def _load_offsets(
        self, g: Group, fresh: bool = False
    ) -> dict[tuple[str, int], tuple[int, str]]:
        if g.offsets is None or fresh:
            found = await self.store.get(self._path(g.group_id))
            loaded: dict[tuple[str, int], tuple[int, str]] = {}
            if found is not None:
                for item in json.loads(found.value)["offsets"]:
                    loaded[(item[0], int(item[1]))] = (int(item[2]), str(item[3]))
            if g.offsets is None or fresh:
                g.offsets = loaded
                g.version = -1 if found is None else found.stat.version
        return g.offsets

    def commit(
        self,
        group_id: str,
        generation: int,
        member_id: str,
        offsets: list[tuple[str, int, int, str]],
    ) -> Deferred[int]:
        """OffsetCommit of (topic, partition, offset, metadata); fires with the error code
        once durable. Generation -1 is a commit from outside the group (assign-based), taken
        only while the group has no members."""
        if not group_id:
            return succeed(c.INVALID_GROUP_ID)
        g = self._group(group_id)
        if generation >= 0 or member_id:
            if member_id not in g.members:
                return succeed(c.UNKNOWN_MEMBER_ID)
            if generation != g.generation:
                return succeed(c.ILLEGAL_GENERATION)
        elif g.members:
            # From outside the group (an admin tool, an assign-based consumer) while it has
            # members: Kafka refuses it, so a running group's offsets change only by its own.
            return succeed(c.UNKNOWN_MEMBER_ID)
        return Deferred.fromCoroutine(self._commit(g, offsets))

    async def _commit(self, g: Group, offsets: list[tuple[str, int, int, str]]) -> int:
        try:
            self.store_path_ok(g.group_id)
        except ValueError:
            return c.INVALID_GROUP_ID
        await g.writes.acquire()
        try:
            written = await self._write(g, offsets)
        finally:
            g.writes.release()
        if not written:
            return c.NOT_COORDINATOR
        if self.on_commit is not None:
            try:
                self.on_commit(g.group_id, [(t, p, o) for t, p, o, _ in offsets])
            except Exception:
                log.exception("commit listener failed", extra=kv(group=g.group_id))
        return c.NONE

    async def _write(self, g: Group, offsets: list[tuple[str, int, int, str]]) -> bool:
        """Apply the commit on top of the stored document by compare-and-set (module doc)."""
        current = await self._load_offsets(g)
        for _ in range(_COMMIT_ATTEMPTS):
            if self.is_coordinator is not None and not self.is_coordinator(g.group_id):
                return False
            for topic, partition, offset, metadata in offsets:
                current[(topic, partition)] = (offset, metadata)
            doc = {"offsets": [[t, p, o, md] for (t, p), (o, md) in sorted(current.items())]}
            try:
                stat = await self.store.put(
                    self._path(g.group_id), json.dumps(doc).encode(), g.version
                )
            except BadVersionError:
                # Someone else wrote the group's offsets: start from what they wrote.
                log.info("group offsets changed elsewhere", extra=kv(group=g.group_id))
                current = await self._load_offsets(g, fresh=True)
                continue
            g.version = stat.version
            return True
        return False

    def fetch_offsets(self, group_id: str) -> Deferred[dict[tuple[str, int], tuple[int, str]]]:
        """The group's committed offsets (none for a group id the store cannot name)."""
        try:
            self.store_path_ok(group_id)
        except ValueError:
            return succeed({})
        g = self._group(group_id)
        if not self.fresh_offsets:
            return Deferred.fromCoroutine(self._load_offsets(g))
        return Deferred.fromCoroutine(self._fresh_offsets(g))

    async def _fresh_offsets(self, g: Group) -> dict[tuple[str, int], tuple[int, str]]:
        await g.writes.acquire()
        try:
            return dict(await self._load_offsets(g, fresh=True))
        finally:
            g.writes.release()

    def forget_topic(self, topic: str) -> Deferred[None]:
        """Drop every group's committed offsets of ``topic``, which was deleted: a topic
        created again under its name starts with none, as on Kafka."""
        return Deferred.fromCoroutine(self._forget_topic(topic))

    async def _forget_topic(self, topic: str) -> None:
        for name in await self.store.children(GROUPS_ROOT):
            if not name.startswith("g-"):
                continue
            group_id = unquote(name[2:])
            g = self.groups.get(group_id)
            if g is not None:
                await g.writes.acquire()  # after any commit under way, before the next
            try:
                while True:
                    found = await self.store.get(self._path(group_id))
                    if found is None:
                        break
                    items = json.loads(found.value)["offsets"]
                    kept = [item for item in items if item[0] != topic]
                    if len(kept) == len(items):
                        break
                    doc = json.dumps({"offsets": kept}).encode()
                    try:
                        await self.store.put(self._path(group_id), doc, found.stat.version)
                    except BadVersionError:
                        continue
                    if g is not None:
                        g.offsets = None  # read again at its next use
                    log.info(
                        "offsets of a deleted topic dropped", extra=kv(group=group_id, topic=topic)
                    )
                    break
            finally:
                if g is not None:
                    g.writes.release()

    def store_path_ok(self, group_id: str) -> None:
        """Raise ValueError if the group's offsets cannot be stored (too long a name)."""
        if len(self._path(group_id).encode("utf-8", "surrogatepass")) > 1024 or not group_id:
            raise ValueError(f"group id {group_id[:50]!r}... cannot be stored")

    def forget(self, group_id: str) -> None:
        """Drop the group's members and cached offsets: this broker no longer coordinates
        it. Waiting joins and syncs get NOT_COORDINATOR, so their members find the new
        coordinator."""
        g = self.groups.pop(group_id, None)
        if g is not None:
            if g.members:
                log.info("group handed over", extra=kv(group=group_id, members=len(g.members)))
            self._stop_group(g, c.NOT_COORDINATOR)

    def close(self) -> None:
        """Cancel every timer and answer every waiting request."""
        for g in self.groups.values():
            self._stop_group(g, c.COORDINATOR_NOT_AVAILABLE)

    def _stop_group(self, g: Group, error: int) -> None:
        if g.rebalance_timer is not None and g.rebalance_timer.active():
            g.rebalance_timer.cancel()
        g.rebalance_timer = None
        for m in g.members.values():
            if m.expiry is not None and m.expiry.active():
                m.expiry.cancel()
            if m.join is not None:
                d, m.join = m.join, None
                d.callback(JoinResult(error, member_id=m.member_id))
            if m.sync is not None:
                s, m.sync = m.sync, None
                s.callback((error, b""))
        g.state = DEAD
