"""The MetadataStore contract (Rules 1-8 of ``polybroker/metadata/api.py``), one body per rule,
run over every implementation by the ``metadata`` fixture of this folder's conftest."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import deferLater

from polybroker.metadata.api import (
    BadVersionError,
    EventType,
    MetadataError,
    NotEmptyError,
    NotFoundError,
    Notification,
    StoreClosedError,
)

Harness = Any  # StoreHarness from conftest.py


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait on the reactor, bounded, until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await deferLater(reactor, 0.005, lambda: None)


async def failure_of(d: Deferred[Any]) -> BaseException:
    """Await ``d`` and return the exception it failed with (fail the test if it succeeded)."""
    try:
        result = await d
    except Exception as e:
        return e
    raise AssertionError(f"expected a failure, got {result!r}")


class Recorder:
    """Collects notifications; ``settle`` waits until a sentinel change has been seen, so
    every earlier notification has been delivered too (notifications arrive in order)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.events: list[tuple[EventType, str]] = []
        self._sentinel = 0
        store.watch("/zz-sentinel", self)

    def __call__(self, n: Notification) -> None:
        self.events.append((n.type, n.path))

    def watch(self, *paths: str) -> list[Callable[[], None]]:
        return [self.store.watch(p, self) for p in paths]

    async def settle(self) -> list[tuple[EventType, str]]:
        """Return (and forget) every notification up to a sentinel change, sentinel excluded."""
        self._sentinel += 1
        await self.store.put("/zz-sentinel", b"%d" % self._sentinel)
        await eventually(lambda: any(p == "/zz-sentinel" for _, p in self.events))
        got = [e for e in self.events if e[1] != "/zz-sentinel"]
        self.events.clear()
        return got


# ---------------------------------------------------------------------------------------------
# Rule 1 and Rule 2: paths, creation, versions
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_put_creates_at_version_zero_and_each_put_adds_one(metadata: Harness) -> None:
    """A new node starts at version 0 with its value; every put adds one to the version."""
    store = metadata.store
    assert await store.get("/a") is None
    assert await store.exists("/a") is None
    stat = await store.put("/a", b"one")
    assert (stat.version, stat.ephemeral) == (0, False)
    got = await store.get("/a")
    assert got.value == b"one"
    assert got.stat == stat
    for n in range(1, 4):
        stat = await store.put("/a", b"v%d" % n)
        assert stat.version == n
    got = await store.get("/a")
    assert (got.value, got.stat.version) == (b"v3", 3)
    assert got.stat.modified_ms >= got.stat.created_ms
    assert (await store.exists("/a")) == got.stat


@pytest_twisted.ensureDeferred
async def test_put_creates_missing_parents_as_empty_persistent_nodes(metadata: Harness) -> None:
    """Putting a deep path creates every missing ancestor, empty, persistent, at version 0."""
    store = metadata.store
    await store.put("/p/q/r/leaf", b"x")
    for path in ("/p", "/p/q", "/p/q/r"):
        got = await store.get(path)
        assert got is not None, path
        assert (got.value, got.stat.version, got.stat.ephemeral) == (b"", 0, False)
    assert await store.children("/p/q") == ["r"]
    assert "p" in await store.children("/")
    assert (await store.get("/p/q/r/leaf")).value == b"x"


@pytest.mark.parametrize("bad", ["a", "", "/a/", "/a//b", "//", "/a/./b", "/a/../b", "/a\x00b"])
@pytest_twisted.ensureDeferred
async def test_invalid_paths_fail_and_change_nothing(metadata: Harness, bad: str) -> None:
    """A relative path, a trailing slash or an empty, '.', '..' or NUL name fails every
    operation with ValueError and creates nothing."""
    store = metadata.store
    for d in (
        store.put(bad, b"x"),
        store.get(bad),
        store.delete(bad),
        store.children(bad),
        store.exists(bad),
        store.create_sequential(f"{bad}/s-" if bad else "s-", b"x"),
    ):
        assert isinstance(await failure_of(d), ValueError)
    assert await store.children("/") == []


# ---------------------------------------------------------------------------------------------
# Rule 3: compare-and-set
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_compare_and_set_succeeds_on_the_expected_version(metadata: Harness) -> None:
    """put with the node's current version replaces it; -1 creates a missing node."""
    store = metadata.store
    assert (await store.put("/cas", b"a", expected_version=-1)).version == 0
    assert (await store.put("/cas", b"b", expected_version=0)).version == 1
    assert (await store.put("/cas", b"c", expected_version=1)).version == 2
    assert (await store.get("/cas")).value == b"c"


@pytest_twisted.ensureDeferred
async def test_compare_and_set_failures_change_nothing(metadata: Harness) -> None:
    """A wrong version, -1 on an existing node, or a version on a missing node fails with
    BadVersionError and leaves value and version as they were."""
    store = metadata.store
    await store.put("/cas", b"a")
    await store.put("/cas", b"b")
    for expected in (0, 2, 7, -1):
        err = await failure_of(store.put("/cas", b"lost", expected_version=expected))
        assert isinstance(err, BadVersionError), expected
    got = await store.get("/cas")
    assert (got.value, got.stat.version) == (b"b", 1)
    assert isinstance(
        await failure_of(store.put("/missing/x", b"x", expected_version=0)), BadVersionError
    )
    assert await store.exists("/missing/x") is None
    assert await store.exists("/missing") is None


@pytest_twisted.ensureDeferred
async def test_concurrent_creates_with_minus_one_have_exactly_one_winner(
    metadata: Harness,
) -> None:
    """Of many racing creates with expected_version=-1, exactly one succeeds."""
    store = metadata.store
    results = await DeferredList(
        [store.put("/race", b"%d" % i, expected_version=-1) for i in range(10)],
        consumeErrors=True,
    )
    winners = [i for i, (ok, _) in enumerate(results) if ok]
    assert len(winners) == 1
    assert all(r.check(BadVersionError) for ok, r in results if not ok)
    assert (await store.get("/race")).value == b"%d" % winners[0]


# ---------------------------------------------------------------------------------------------
# Rule 4: delete
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_delete_removes_a_leaf_and_refuses_missing_and_non_empty(metadata: Harness) -> None:
    """delete removes a leaf; a missing node fails NotFoundError; a node with children fails
    NotEmptyError and stays."""
    store = metadata.store
    await store.put("/d/child", b"x")
    assert isinstance(await failure_of(store.delete("/d")), NotEmptyError)
    assert await store.exists("/d") is not None
    await store.delete("/d/child")
    assert await store.get("/d/child") is None
    assert await store.children("/d") == []
    await store.delete("/d")
    assert await store.exists("/d") is None
    assert isinstance(await failure_of(store.delete("/d")), NotFoundError)
    assert isinstance(await failure_of(store.delete("/never/was")), NotFoundError)


@pytest_twisted.ensureDeferred
async def test_delete_honours_the_expected_version(metadata: Harness) -> None:
    """delete with a wrong version fails BadVersionError and keeps the node; with the right
    one it deletes; a deleted node can be created again from version 0."""
    store = metadata.store
    await store.put("/v", b"a")
    await store.put("/v", b"b")
    assert isinstance(await failure_of(store.delete("/v", expected_version=0)), BadVersionError)
    assert (await store.get("/v")).stat.version == 1
    await store.delete("/v", expected_version=1)
    assert await store.get("/v") is None
    assert (await store.put("/v", b"c", expected_version=-1)).version == 0


@pytest_twisted.ensureDeferred
async def test_delete_recursive_removes_a_subtree(metadata: Harness) -> None:
    """delete_recursive removes a node and all below it, and tolerates a missing node."""
    store = metadata.store
    for path in ("/t/a/1", "/t/a/2", "/t/b", "/keep"):
        await store.put(path, b"x")
    await store.delete_recursive("/t")
    assert await store.exists("/t") is None
    assert await store.children("/") == ["keep"]
    await store.delete_recursive("/t")


# ---------------------------------------------------------------------------------------------
# children
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_children_are_sorted_names_and_empty_for_a_missing_node(metadata: Harness) -> None:
    """children returns the sorted names (not paths) of direct children only; [] if missing."""
    store = metadata.store
    for name in ("m", "b", "z", "a10", "a2"):
        await store.put(f"/c/{name}", b"")
    await store.put("/c/b/deeper", b"")
    assert await store.children("/c") == ["a10", "a2", "b", "m", "z"]
    assert await store.children("/c/b") == ["deeper"]
    assert await store.children("/c/m") == []
    assert await store.children("/nothing/here") == []


# ---------------------------------------------------------------------------------------------
# Rule 6: sequential nodes
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_sequential_nodes_get_increasing_ten_digit_suffixes(metadata: Harness) -> None:
    """create_sequential appends a zero-padded 10-digit suffix that strictly increases, and
    creates missing parents."""
    store = metadata.store
    paths = [await store.create_sequential("/seq/item-", b"%d" % i) for i in range(5)]
    suffixes = [p.removeprefix("/seq/item-") for p in paths]
    assert all(len(s) == 10 and s.isdigit() for s in suffixes)
    assert [int(s) for s in suffixes] == sorted({int(s) for s in suffixes})
    assert await store.children("/seq") == [p.rsplit("/", 1)[1] for p in paths]
    for i, p in enumerate(paths):
        assert (await store.get(p)).value == b"%d" % i


@pytest_twisted.ensureDeferred
async def test_concurrent_sequential_creates_are_unique(metadata: Harness) -> None:
    """Many create_sequential calls in flight at once all get distinct, increasing paths in
    the order they were issued."""
    store = metadata.store
    paths = await DeferredList(
        [store.create_sequential("/seq/n-", b"") for _ in range(50)], fireOnOneErrback=True
    )
    names = [p for _, p in paths]
    assert len(set(names)) == 50
    assert names == sorted(names)
    assert len(await store.children("/seq")) == 50


@pytest_twisted.ensureDeferred
async def test_sequence_numbers_are_never_reused(metadata: Harness) -> None:
    """Deleting the newest sequential node, or its whole parent, never lets a later node
    take a suffix that was already handed out."""
    store = metadata.store
    first = await store.create_sequential("/seq/x-", b"")
    second = await store.create_sequential("/seq/x-", b"")
    await store.delete(second)
    third = await store.create_sequential("/seq/x-", b"")
    assert third > second > first
    await store.delete_recursive("/seq")
    fourth = await store.create_sequential("/seq/x-", b"")
    assert fourth > third


@pytest_twisted.ensureDeferred
async def test_sequence_counters_are_per_parent_and_survive_a_reopen(metadata: Harness) -> None:
    """Sequential names under one parent do not disturb another's ordering, and a reopened
    store continues past every suffix handed out before."""
    store = metadata.store
    a1 = await store.create_sequential("/s/a/n-", b"")
    b1 = await store.create_sequential("/s/b/n-", b"")
    a2 = await store.create_sequential("/s/a/n-", b"")
    assert a2 > a1
    await store.close()
    again = await metadata.reopen()
    assert await again.create_sequential("/s/a/n-", b"") > a2
    assert await again.create_sequential("/s/b/n-", b"") > b1


# ---------------------------------------------------------------------------------------------
# Rule 5: ephemeral nodes
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_ephemeral_nodes_vanish_when_the_session_closes(metadata: Harness) -> None:
    """Ephemeral nodes (plain and sequential) are marked so and are gone for the next session
    once their session closed; persistent nodes and auto-created parents stay."""
    store = metadata.store
    stat = await store.put("/eph/me", b"here", ephemeral=True)
    assert stat.ephemeral
    seq = await store.create_sequential("/eph/s-", b"", ephemeral=True)
    await store.put("/eph/stays", b"p")
    assert (await store.get("/eph/me")).stat.ephemeral
    assert (await store.exists(seq)).ephemeral
    await store.close()
    again = await metadata.reopen()
    assert await again.get("/eph/me") is None
    assert await again.exists(seq) is None
    assert await again.children("/eph") == ["stays"]
    assert (await again.get("/eph/stays")).value == b"p"


@pytest_twisted.ensureDeferred
async def test_ephemeral_nodes_cannot_have_children(metadata: Harness) -> None:
    """Creating a node under an ephemeral node fails with MetadataError and creates nothing."""
    store = metadata.store
    await store.put("/e", b"", ephemeral=True)
    err = await failure_of(store.put("/e/child", b""))
    assert isinstance(err, MetadataError)
    assert not isinstance(err, BadVersionError)
    err = await failure_of(store.create_sequential("/e/c-", b""))
    assert isinstance(err, MetadataError)
    assert await store.children("/e") == []


@pytest_twisted.ensureDeferred
async def test_updating_an_ephemeral_node_keeps_it_ephemeral(metadata: Harness) -> None:
    """A plain put on an existing ephemeral node updates its value and version only."""
    store = metadata.store
    await store.put("/e", b"a", ephemeral=True)
    stat = await store.put("/e", b"b")
    assert (stat.version, stat.ephemeral) == (1, True)


# ---------------------------------------------------------------------------------------------
# Rule 7: watches
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_watches_fire_once_per_create_modify_delete_and_children_change(
    metadata: Harness,
) -> None:
    """A watch on a node reports its creation, each change and its deletion once each; a
    watch on its parent reports the children changes, not the child's data changes."""
    store = metadata.store
    await store.put("/w", b"")
    rec = Recorder(store)
    rec.watch("/w", "/w/n")
    await store.put("/w/n", b"1")
    assert await rec.settle() == [
        (EventType.CREATED, "/w/n"),
        (EventType.CHILDREN_CHANGED, "/w"),
    ]
    await store.put("/w/n", b"2")
    await store.put("/w/n", b"3", expected_version=1)
    assert await rec.settle() == [(EventType.MODIFIED, "/w/n"), (EventType.MODIFIED, "/w/n")]
    await store.put("/w", b"parent data")
    assert await rec.settle() == [(EventType.MODIFIED, "/w")]
    await store.delete("/w/n")
    assert await rec.settle() == [
        (EventType.DELETED, "/w/n"),
        (EventType.CHILDREN_CHANGED, "/w"),
    ]


@pytest_twisted.ensureDeferred
async def test_failed_operations_fire_no_watch(metadata: Harness) -> None:
    """A refused compare-and-set or delete changes nothing, so no watch fires."""
    store = metadata.store
    await store.put("/w/n", b"1")
    rec = Recorder(store)
    rec.watch("/w", "/w/n")
    await failure_of(store.put("/w/n", b"x", expected_version=5))
    await failure_of(store.delete("/w"))
    await failure_of(store.delete("/w/other"))
    assert await rec.settle() == []


@pytest_twisted.ensureDeferred
async def test_watches_fire_for_auto_created_parents(metadata: Harness) -> None:
    """Creating a deep path reports each created ancestor to watchers of it and its parent."""
    store = metadata.store
    rec = Recorder(store)
    rec.watch("/a", "/a/b", "/a/b/c")
    await store.put("/a/b/c", b"")
    got = await rec.settle()
    assert sorted(got, key=lambda e: (e[1], e[0].value)) == sorted(
        [
            (EventType.CREATED, "/a"),
            (EventType.CHILDREN_CHANGED, "/a"),
            (EventType.CREATED, "/a/b"),
            (EventType.CHILDREN_CHANGED, "/a/b"),
            (EventType.CREATED, "/a/b/c"),
        ],
        key=lambda e: (e[1], e[0].value),
    )


@pytest_twisted.ensureDeferred
async def test_a_watch_sees_the_change_already_visible_to_get(metadata: Harness) -> None:
    """Reading a node from inside its watch callback returns the value that fired it."""
    store = metadata.store
    reads: list[Deferred[Any]] = []
    store.watch("/vis", lambda n: reads.append(store.get(n.path)))
    for value in (b"a", b"b", b"c"):
        await store.put("/vis", value)
    await eventually(lambda: len(reads) == 3)
    results = await DeferredList(reads, fireOnOneErrback=True)
    assert [r.value for _, r in results] == [b"a", b"b", b"c"]


@pytest_twisted.ensureDeferred
async def test_unwatch_stops_only_that_watch(metadata: Harness) -> None:
    """After its unwatch function is called a watch gets nothing more; another watch on the
    same path keeps firing; calling unwatch twice is harmless."""
    store = metadata.store
    rec = Recorder(store)
    gone: list[Notification] = []
    unwatch = store.watch("/u", gone.append)
    rec.watch("/u")
    await store.put("/u", b"1")
    assert await rec.settle() == [(EventType.CREATED, "/u")]
    assert [n.type for n in gone] == [EventType.CREATED]
    unwatch()
    unwatch()
    await store.put("/u", b"2")
    await store.delete("/u")
    assert await rec.settle() == [(EventType.MODIFIED, "/u"), (EventType.DELETED, "/u")]
    assert [n.type for n in gone] == [EventType.CREATED]


@pytest_twisted.ensureDeferred
async def test_a_failing_watch_callback_does_not_stop_others(metadata: Harness) -> None:
    """A watch callback that raises neither breaks the operation nor other watchers."""
    store = metadata.store

    def broken(n: Notification) -> None:
        raise RuntimeError("watcher bug")

    store.watch("/f", broken)
    rec = Recorder(store)
    rec.watch("/f")
    assert (await store.put("/f", b"x")).version == 0
    assert await rec.settle() == [(EventType.CREATED, "/f")]


# ---------------------------------------------------------------------------------------------
# Rule 8 and close
# ---------------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_operations_after_close_fail_with_store_closed(metadata: Harness) -> None:
    """After close every operation fails with StoreClosedError; close is idempotent."""
    store = metadata.store
    await store.put("/x", b"x")
    await store.close()
    await store.close()
    for d in (
        store.get("/x"),
        store.put("/x", b"y"),
        store.create_sequential("/x-", b""),
        store.delete("/x"),
        store.children("/"),
        store.exists("/x"),
    ):
        assert isinstance(await failure_of(d), StoreClosedError)
    with pytest.raises(StoreClosedError):
        store.watch("/x", lambda n: None)


@pytest_twisted.ensureDeferred
async def test_persistent_data_and_versions_outlive_the_session(metadata: Harness) -> None:
    """What one session wrote, with its versions, is what the next session reads."""
    store = metadata.store
    await store.put("/keep/a", b"1")
    await store.put("/keep/a", b"2")
    await store.put("/keep/b", b"b")
    await store.delete("/keep/b")
    await store.close()
    again = await metadata.reopen()
    got = await again.get("/keep/a")
    assert (got.value, got.stat.version) == (b"2", 1)
    assert await again.children("/keep") == ["a"]
    assert (await again.put("/keep/a", b"3", expected_version=1)).version == 2


@pytest_twisted.ensureDeferred
async def test_operations_complete_in_the_order_they_were_issued(metadata: Harness) -> None:
    """Deferreds of a burst of writes and reads fire in issue order, and each read sees
    exactly the writes issued before it."""
    store = metadata.store
    order: list[int] = []
    ds: list[Deferred[Any]] = []
    for i in range(20):
        d = store.put("/o", b"%d" % i) if i % 2 == 0 else store.get("/o")
        d.addCallback(lambda r, i=i: (order.append(i), r)[1])
        ds.append(d)
    results = await DeferredList(ds, fireOnOneErrback=True)
    assert order == list(range(20))
    for i in range(1, 20, 2):
        assert results[i][1].value == b"%d" % (i - 1)
