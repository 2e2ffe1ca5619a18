"""The few admin REST calls the data source plans with: partitions, topics, last ids, ledgers."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from polybroker.ledger.direct import LedgerLayout, layouts_from_stats
from polybroker.spark.offsets import (
    EARLIEST,
    Boundary,
    after_last,
    base_topic,
    full_topic,
    readable_end,
)


class AdminError(RuntimeError):
    """The admin REST API answered an error or could not be reached."""


def _position(text: Any) -> tuple[int, int] | None:
    """``(ledger, entry)`` of a ``"ledger:entry"`` position, None if it is not one."""
    ledger, sep, entry = str(text).partition(":")
    try:
        return (int(ledger), int(entry)) if sep else None
    except ValueError:
        return None


class PulsarAdmin:
    """A blocking client of the broker's ``/admin/v2`` API (driver side only)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str) -> Any:
        """GET ``path``; the decoded JSON, or None for 404."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise AdminError(f"GET {path}: {e.code} {e.read()[:200]!r}") from None
        except OSError as e:
            raise AdminError(f"GET {path}: {e}") from None

    @staticmethod
    def _path(topic: str) -> str:
        domain, _, rest = full_topic(topic).partition("://")
        return f"/admin/v2/{domain}/" + "/".join(quote(p, safe="") for p in rest.split("/"))

    def partitions(self, topic: str) -> list[str]:
        """The partitions of a partitioned topic, or the topic itself."""
        topic = full_topic(topic)
        meta = self._get(self._path(topic) + "/partitions")
        n = int(meta.get("partitions", 0)) if isinstance(meta, dict) else 0
        return [f"{topic}-partition-{i}" for i in range(n)] if n > 0 else [topic]

    def matching(self, pattern: str) -> list[str]:
        """Topic partitions whose name (or partitioned topic's name) matches ``pattern``."""
        scheme, sep, rest = pattern.partition("://")
        if not sep:
            scheme, rest = "persistent", pattern
        parts = rest.split("/")
        if len(parts) < 3:
            tenant, ns = "public", "default"
            pattern = f"persistent://public/default/{pattern}"
        else:
            tenant, ns = parts[0], parts[1]
            pattern = f"{scheme}://{rest}"
        regex = re.compile(pattern)
        names = self._get(f"/admin/v2/namespaces/{quote(tenant)}/{quote(ns)}/topics") or []
        return sorted(
            n
            for n in names
            if isinstance(n, str) and (regex.fullmatch(n) or regex.fullmatch(base_topic(n)))
        )

    def last_boundary(self, topic: str) -> Boundary:
        """The boundary after the topic partition's last message (EARLIEST when it has none)."""
        last = self._get(self._path(topic) + "/lastMessageId")
        if not isinstance(last, dict):
            return EARLIEST
        return after_last((int(last.get("ledgerId", -1)), int(last.get("entryId", -1))))

    def ledgers(self, topic: str) -> list[tuple[int, int]]:
        """``(ledgerId, entries)`` of the topic partition's ledgers, oldest first."""
        return self._ledgers(self._get(self._path(topic) + "/internalStats"))

    def storage(
        self, topic: str
    ) -> tuple[list[tuple[int, int]], dict[int, LedgerLayout], Boundary]:
        """``ledgers()``, the storage layout of each ledger that tells it, and the boundary
        before which every entry can be read from storage (``offsets.readable_end``: the sealed
        ledgers, then the open one up to its last add confirmed)."""
        stats = self._get(self._path(topic) + "/internalStats?metadata=true")
        if not isinstance(stats, dict):
            return self._ledgers(stats), {}, EARLIEST
        infos = stats.get("ledgers", [])
        try:
            layouts = layouts_from_stats(infos, open_ledgers=True)
            sealed = {int(x["ledgerId"]) for x in infos if x.get("sealed")}
        except (KeyError, TypeError, ValueError) as e:
            raise AdminError(f"{topic}: unusable ledger metadata: {e}") from None
        ledgers = self._ledgers(stats)
        confirmed = _position(stats.get("lastConfirmedEntry"))
        if confirmed is not None and confirmed[0] not in layouts:
            confirmed = None
        return ledgers, layouts, readable_end(ledgers, sealed, confirmed)

    @staticmethod
    def _ledgers(stats: Any) -> list[tuple[int, int]]:
        if not isinstance(stats, dict):
            return []
        out = [(int(x["ledgerId"]), int(x.get("entries", 0))) for x in stats.get("ledgers", [])]
        # Pulsar reports the open ledger's entries in currentLedgerEntries, not in the list.
        if out and out[-1][1] == 0 and stats.get("currentLedgerEntries"):
            out[-1] = (out[-1][0], int(stats["currentLedgerEntries"]))
        return sorted(out)

    def schema(self, topic: str) -> dict[str, Any] | None:
        """The topic's latest registered schema (``type``, ``data``), or None."""
        _, _, rest = full_topic(base_topic(topic)).partition("://")
        got = self._get(
            "/admin/v2/schemas/" + "/".join(quote(p) for p in rest.split("/")) + "/schema"
        )
        return got if isinstance(got, dict) else None
