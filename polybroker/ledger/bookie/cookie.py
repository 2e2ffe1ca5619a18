"""Bookie identity (I9): a cookie binds an instance id to the bookie's data directories.

Rule 1: the first start writes a cookie into each data directory (``journal/cookie``,
        ``ledgers/cookie``) and then the master cookie ``<data dir>/cookie``; every later start
        requires the master and each directory's copy to carry the same instance id.
Rule 2: a data dir with journal or ledger data but no master cookie, a directory whose cookie is
        missing or different (a wiped or swapped disk), an unreadable cookie or a newer layout
        version refuses to start with ``CookieError`` saying what is wrong. Directories holding
        nothing but their cookie (a first start that crashed half-way) are initialised afresh.
Rule 3: with a metadata store, the cookie is registered at ``/bookies/cookies/<host:port>``; a
        different instance id registered there for the same address refuses the start (a wiped
        bookie must not rejoin under its old address as if it still held the data).
Rule 4: the announcement ``/bookies/available/<host:port>`` is an ephemeral node of the current
        session: one left by an earlier run (a crash whose session has not expired yet) is
        deleted and created again, never merely overwritten (it would vanish with the old
        session, leaving a running bookie unannounced).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Generator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, inlineCallbacks

from polybroker.ledger.api import StorageError
from polybroker.ledger.bookie.journal import write_atomically
from polybroker.metadata.api import BadVersionError, MetadataError, MetadataStore, NotFoundError

LAYOUT_VERSION = 1
COOKIE_FILE = "cookie"
JOURNAL_DIR = "journal"
LEDGERS_DIR = "ledgers"
COOKIES_PATH = "/bookies/cookies"
AVAILABLE_PATH = "/bookies/available"
READONLY_PATH = "/bookies/readonly"  # bookies refusing adds for now (the server's Rule 8)


class CookieError(StorageError):
    """The data dir does not belong to this bookie identity, or is not in a state to start."""


@dataclass(frozen=True)
class Cookie:
    """A bookie's identity and the layout of its data dir."""

    instance_id: str
    layout_version: int
    directories: tuple[str, ...]
    created_ms: int
    address: str = ""  # where the bookie last served from ("" until recorded: Rule 5)

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "instance_id": self.instance_id,
            "layout_version": self.layout_version,
            "directories": list(self.directories),
            "created_ms": self.created_ms,
        }
        if self.address:
            doc["address"] = self.address
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, source: str) -> Cookie:
        try:
            doc = json.loads(raw)
            return cls(
                str(doc["instance_id"]),
                int(doc["layout_version"]),
                tuple(str(d) for d in doc["directories"]),
                int(doc.get("created_ms", 0)),
                str(doc.get("address") or ""),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CookieError(f"cookie {source} is unreadable ({e})") from None


def _has_data(directory: Path) -> bool:
    """Whether ``directory`` holds anything besides its cookie (empty subdirectories count as
    nothing: a bookie creates them before it writes anything)."""
    if not directory.is_dir():
        return False
    for p in directory.rglob("*"):
        if p.is_file() and not (p.parent == directory and p.name == COOKIE_FILE):
            return True
    return False


def _read(path: Path) -> Cookie | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return Cookie.from_bytes(raw, str(path))


def check_or_create(data_dir: Path) -> Cookie:
    """Return the data dir's cookie after checking it against its directories (Rules 1-2),
    creating it on a first start. Raises ``CookieError``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    dirs = (JOURNAL_DIR, LEDGERS_DIR)
    master = _read(data_dir / COOKIE_FILE)
    if master is None:
        with_data = [d for d in dirs if _has_data(data_dir / d)]
        if with_data:
            raise CookieError(
                f"{data_dir} holds bookie data ({', '.join(with_data)}) but no cookie: it does "
                "not belong to a known bookie identity; refusing to start"
            )
        cookie = Cookie(str(uuid.uuid4()), LAYOUT_VERSION, dirs, int(time.time() * 1000))
        for d in dirs:
            (data_dir / d).mkdir(exist_ok=True)
            write_atomically(data_dir / d / COOKIE_FILE, cookie.to_bytes())
        write_atomically(data_dir / COOKIE_FILE, cookie.to_bytes())
        return cookie
    if master.layout_version > LAYOUT_VERSION:
        raise CookieError(
            f"{data_dir} has layout version {master.layout_version}; this bookie reads only "
            f"up to {LAYOUT_VERSION}"
        )
    for d in master.directories:
        path = data_dir / d / COOKIE_FILE
        found = _read(path)
        if found is None:
            raise CookieError(
                f"directory {data_dir / d} has no cookie but {data_dir / COOKIE_FILE} names it: "
                "the directory was wiped or replaced; refusing to start as bookie "
                f"{master.instance_id}"
            )
        if found.instance_id != master.instance_id:
            raise CookieError(
                f"directory {data_dir / d} belongs to bookie {found.instance_id}, not "
                f"{master.instance_id}: disks were swapped or mixed; refusing to start"
            )
    return master


def recorded_port(cookie: Cookie) -> int:
    """The port of the cookie's recorded address, or 0 if none is recorded (Rule 5)."""
    if not cookie.address:
        return 0
    try:
        return int(cookie.address.rpartition(":")[2])
    except ValueError:
        raise CookieError(f"cookie records an unreadable address {cookie.address!r}") from None


def check_address(cookie: Cookie, address: str, *, allow_change: bool = False) -> Cookie:
    """Return the cookie as it must be recorded for a start at ``address`` (Rule 5): the same
    one, or one naming ``address``. Raises ``CookieError`` if the data dir was registered
    under another address and ``allow_change`` is false. Changes nothing on disk."""
    if cookie.address == address:
        return cookie
    if cookie.address and not allow_change:
        raise CookieError(
            f"this data dir is bookie {cookie.instance_id} at {cookie.address}, not {address}: "
            "ledgers name their bookies by address, so its data would be unreachable under "
            f"the new one. Start it as {cookie.address} again (same port, bind address and "
            "advertisedAddress), or set allowBookieAddressChange=true (--allow-address-change) "
            f"to move it (ledgers that name {cookie.address} then lose that copy: a cluster's "
            "auditor re-replicates them from their other copies; a ledger with no other copy "
            "becomes unreadable)"
        )
    return replace(cookie, address=address)


def record_address(data_dir: Path, cookie: Cookie) -> None:
    """Write ``cookie`` (with its address) as the data dir's master cookie, atomically."""
    write_atomically(data_dir / COOKIE_FILE, cookie.to_bytes())


@inlineCallbacks
def _registered_elsewhere(
    store: MetadataStore, cookie: Cookie, address: str
) -> Generator[Deferred[Any], Any, str | None]:
    """Another address under which ``cookie``'s instance id is registered, or None."""
    names = yield store.children(COOKIES_PATH)
    for name in names:
        if name == address:
            continue
        got = yield store.get(f"{COOKIES_PATH}/{name}")
        if got is not None and Cookie.from_bytes(got.value, name).instance_id == cookie.instance_id:
            return str(name)
    return None


@inlineCallbacks
def register(
    store: MetadataStore, address: str, cookie: Cookie, *, allow_address_change: bool = False
) -> Generator[Deferred[Any], Any, None]:
    """Register the cookie for ``address`` and announce the bookie as available (Rule 3).

    Fails with ``CookieError`` if another instance id is registered for the address, or (Rule
    5, unless ``allow_address_change``) if this address is new and the instance id is
    registered under another one; a refusal changes nothing in the store."""
    path = f"{COOKIES_PATH}/{address}"
    for _ in range(3):
        got = yield store.get(path)
        if got is None:
            if not allow_address_change:
                elsewhere = yield _registered_elsewhere(store, cookie, address)
                if elsewhere is not None:
                    raise CookieError(
                        f"bookie {cookie.instance_id} is registered at {elsewhere} in the "
                        f"metadata store, not at {address}: ledgers name their bookies by "
                        f"address; start it as {elsewhere} again, or set "
                        "allowBookieAddressChange=true to move it"
                    )
            try:
                yield store.put(path, cookie.to_bytes(), expected_version=-1)
            except BadVersionError:
                continue  # someone registered at the same moment: read what they wrote
            break
        registered = Cookie.from_bytes(got.value, path)
        if registered.instance_id != cookie.instance_id:
            raise CookieError(
                f"bookie {registered.instance_id} is registered at {address} in the metadata "
                f"store, but this data dir is bookie {cookie.instance_id}: a bookie whose disk "
                "was wiped must not rejoin under its old address (decommission the old "
                f"identity by deleting {path} once its ledgers are re-replicated)"
            )
        break
    info = json.dumps({"instance_id": cookie.instance_id, "address": address}).encode()
    available = f"{AVAILABLE_PATH}/{address}"
    for _ in range(5):
        try:
            yield store.put(available, info, expected_version=-1, ephemeral=True)
            return
        except BadVersionError:
            pass
        # A node left by an earlier run of this bookie (killed: its session has not expired
        # yet) would vanish with that session: replace it by one of this session (Rule 4).
        got = yield store.get(available)
        if got is not None:
            with contextlib.suppress(NotFoundError, BadVersionError):
                yield store.delete(available, got.stat.version)
    raise MetadataError(f"cannot announce {available}: it keeps being recreated")


@inlineCallbacks
def unregister(store: MetadataStore, address: str) -> Generator[Deferred[Any], Any, None]:
    """Withdraw the availability announcement (the cookie registration stays)."""
    try:
        yield store.delete(f"{AVAILABLE_PATH}/{address}")
    except MetadataError:
        return  # already gone (session ended): nothing to withdraw
