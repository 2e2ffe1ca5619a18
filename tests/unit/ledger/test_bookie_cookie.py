"""Bookie identity: the cookie binds an instance id to its directories and to its address."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from polybroker.ledger.bookie.cookie import (
    Cookie,
    CookieError,
    check_address,
    check_or_create,
    record_address,
    recorded_port,
    register,
    unregister,
)
from polybroker.metadata.api import (
    BadVersionError,
    GetResult,
    MetadataStore,
    NotFoundError,
    Stat,
)


def test_first_start_creates_a_cookie_in_every_directory(tmp_path: Path) -> None:
    """A fresh data dir gets one instance id, written in the master and each directory."""
    cookie = check_or_create(tmp_path)
    for place in ("cookie", "journal/cookie", "ledgers/cookie"):
        assert Cookie.from_bytes((tmp_path / place).read_bytes(), place) == cookie
    assert check_or_create(tmp_path) == cookie


def test_data_without_a_cookie_refuses(tmp_path: Path) -> None:
    """Journal or ledger data with no cookie does not belong to any known identity."""
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "0000000000000001.jnl").write_bytes(b"x")
    with pytest.raises(CookieError, match="no cookie"):
        check_or_create(tmp_path)


def test_a_wiped_directory_refuses(tmp_path: Path) -> None:
    """A ledgers directory emptied behind the bookie's back is detected."""
    check_or_create(tmp_path)
    shutil.rmtree(tmp_path / "ledgers")
    (tmp_path / "ledgers").mkdir()
    with pytest.raises(CookieError, match="wiped or replaced"):
        check_or_create(tmp_path)


def test_a_swapped_directory_refuses(tmp_path: Path) -> None:
    """A journal directory of another bookie is detected."""
    check_or_create(tmp_path / "a")
    check_or_create(tmp_path / "b")
    shutil.rmtree(tmp_path / "a" / "journal")
    shutil.copytree(tmp_path / "b" / "journal", tmp_path / "a" / "journal")
    with pytest.raises(CookieError, match="swapped"):
        check_or_create(tmp_path / "a")


def test_an_unreadable_cookie_refuses(tmp_path: Path) -> None:
    """A damaged cookie is reported, not replaced."""
    check_or_create(tmp_path)
    (tmp_path / "cookie").write_bytes(b"{not json")
    with pytest.raises(CookieError, match="unreadable"):
        check_or_create(tmp_path)


def test_a_newer_layout_refuses(tmp_path: Path) -> None:
    """A data dir written by a newer layout is not touched."""
    c = check_or_create(tmp_path)
    newer = Cookie(c.instance_id, 99, c.directories, c.created_ms)
    (tmp_path / "cookie").write_bytes(newer.to_bytes())
    with pytest.raises(CookieError, match="layout version 99"):
        check_or_create(tmp_path)


def test_half_done_first_start_is_initialised_afresh(tmp_path: Path) -> None:
    """Directories holding only their cookie (a crash during the first start) start over."""
    first = check_or_create(tmp_path)
    (tmp_path / "cookie").unlink()
    again = check_or_create(tmp_path)
    assert again.instance_id != first.instance_id


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_first_address_is_recorded_and_kept(tmp_path: Path) -> None:
    """A first start records its address in the master cookie; later starts read it back, and
    the same address passes the check unchanged."""
    cookie = check_or_create(tmp_path)
    assert cookie.address == ""
    assert recorded_port(cookie) == 0
    named = check_address(cookie, "127.0.0.1:4001")
    assert named.address == "127.0.0.1:4001"
    assert named.instance_id == cookie.instance_id
    record_address(tmp_path, named)
    again = check_or_create(tmp_path)
    assert again == named
    assert recorded_port(again) == 4001
    assert check_address(again, "127.0.0.1:4001") is again


def test_a_start_under_another_address_refuses_and_changes_nothing(tmp_path: Path) -> None:
    """Another port or another host than the recorded address refuses with a message naming
    both addresses and the way out; the data dir is left byte for byte as it was."""
    record_address(tmp_path, check_address(check_or_create(tmp_path), "127.0.0.1:4001"))
    before = _snapshot(tmp_path)
    cookie = check_or_create(tmp_path)
    for other in ("127.0.0.1:4002", "10.0.0.7:4001"):
        with pytest.raises(CookieError) as refused:
            check_address(cookie, other)
        message = str(refused.value)
        assert "127.0.0.1:4001" in message
        assert other in message
        assert "allowBookieAddressChange" in message
    assert _snapshot(tmp_path) == before


def test_an_allowed_move_names_the_new_address(tmp_path: Path) -> None:
    """With the move allowed, the cookie to record names the new address, same identity."""
    old = check_address(check_or_create(tmp_path), "127.0.0.1:4001")
    moved = check_address(old, "127.0.0.1:4002", allow_change=True)
    assert moved.address == "127.0.0.1:4002"
    assert moved.instance_id == old.instance_id


def test_a_cookie_without_an_address_adopts_the_next_one(tmp_path: Path) -> None:
    """A cookie written before addresses were recorded reads as having none, and takes the
    address of its next start."""
    cookie = check_or_create(tmp_path)
    raw = (tmp_path / "cookie").read_bytes()
    assert b"address" not in raw
    assert Cookie.from_bytes(raw, "x").address == ""
    assert check_address(cookie, "h:9").address == "h:9"


def test_an_unreadable_recorded_address_refuses(tmp_path: Path) -> None:
    """A recorded address with no numeric port is reported, not guessed at."""
    cookie = Cookie("id", 1, ("journal", "ledgers"), 0, "host-without-port")
    with pytest.raises(CookieError, match="unreadable address"):
        recorded_port(cookie)


class FakeStore:
    """Just enough of a metadata store for registration: get, put with CAS, delete."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bytes, int, bool]] = {}
        self.before_put: Callable[[], None] | None = None

    def get(self, path: str) -> Deferred[GetResult | None]:
        node = self.nodes.get(path)
        if node is None:
            return succeed(None)
        return succeed(GetResult(node[0], Stat(node[1], node[2], 0, 0)))

    def put(
        self,
        path: str,
        value: bytes,
        expected_version: int | None = None,
        *,
        ephemeral: bool = False,
    ) -> Deferred[Stat]:
        if self.before_put is not None:
            hook, self.before_put = self.before_put, None
            hook()
        node = self.nodes.get(path)
        if expected_version == -1 and node is not None:
            return fail(BadVersionError(path))
        version = 0 if node is None else node[1] + 1
        self.nodes[path] = (value, version, ephemeral)
        return succeed(Stat(version, ephemeral, 0, 0))

    def delete(self, path: str, expected_version: int | None = None) -> Deferred[None]:
        if self.nodes.pop(path, None) is None:
            return fail(NotFoundError(path))
        return succeed(None)

    def children(self, path: str) -> Deferred[list[str]]:
        prefix = path + "/"
        return succeed(
            sorted(
                p[len(prefix) :]
                for p in self.nodes
                if p.startswith(prefix) and "/" not in p[len(prefix) :]
            )
        )


def _run(d: Deferred[Any]) -> Any:
    box: list[Any] = []
    d.addBoth(box.append)
    assert box
    if isinstance(box[0], Failure):
        box[0].raiseException()
    return box[0]


def _store(fake: FakeStore) -> MetadataStore:
    return fake  # type: ignore[return-value]


def test_registration_records_the_cookie_and_announces_the_bookie(tmp_path: Path) -> None:
    """A first registration stores the cookie for the address and an ephemeral availability."""
    store = FakeStore()
    cookie = check_or_create(tmp_path)
    _run(register(_store(store), "127.0.0.1:3181", cookie))
    value, _, ephemeral = store.nodes["/bookies/cookies/127.0.0.1:3181"]
    assert Cookie.from_bytes(value, "x").instance_id == cookie.instance_id
    assert ephemeral is False
    assert store.nodes["/bookies/available/127.0.0.1:3181"][2] is True
    _run(register(_store(store), "127.0.0.1:3181", cookie))  # the same bookie again: fine
    _run(unregister(_store(store), "127.0.0.1:3181"))
    assert "/bookies/available/127.0.0.1:3181" not in store.nodes
    _run(unregister(_store(store), "127.0.0.1:3181"))  # already gone: fine


def test_a_wiped_bookie_cannot_rejoin_under_its_old_address(tmp_path: Path) -> None:
    """Another instance id registered for the address refuses the start, saying why."""
    store = FakeStore()
    _run(register(_store(store), "h:1", check_or_create(tmp_path / "old")))
    with pytest.raises(CookieError, match="wiped must not rejoin"):
        _run(register(_store(store), "h:1", check_or_create(tmp_path / "new")))
    assert "/bookies/available/h:1" in store.nodes  # the old registration is untouched


def test_a_registration_race_rereads_the_winner(tmp_path: Path) -> None:
    """If another bookie registers the address first, its identity is checked, not overwritten."""
    store = FakeStore()
    winner = check_or_create(tmp_path / "w")

    def sneak_in() -> None:
        store.nodes["/bookies/cookies/h:2"] = (winner.to_bytes(), 0, False)

    store.before_put = sneak_in
    with pytest.raises(CookieError):
        _run(register(_store(store), "h:2", check_or_create(tmp_path / "late")))


def test_an_identity_registered_elsewhere_is_refused_at_a_new_address(tmp_path: Path) -> None:
    """A data dir whose cookie records no address (written before addresses were recorded)
    but whose identity is registered at another address is refused at a new one, with nothing
    written to the store; allowed, it registers there too; the old address stays known."""
    store = FakeStore()
    cookie = check_or_create(tmp_path)
    _run(register(_store(store), "h:1", cookie))
    _run(unregister(_store(store), "h:1"))
    before = dict(store.nodes)
    with pytest.raises(CookieError, match="registered at h:1"):
        _run(register(_store(store), "h:2", cookie))
    assert store.nodes == before
    _run(register(_store(store), "h:2", cookie, allow_address_change=True))
    assert "/bookies/available/h:2" in store.nodes
    assert "/bookies/cookies/h:1" in store.nodes
    _run(register(_store(store), "h:2", cookie))  # registered there now: no scan refuses it
