"""Placement: which bookies form a new ensemble, which one replaces a failed member.

Rule 1: an ensemble never holds the same bookie twice, and a replacement is never a bookie of the
        current ensemble nor one excluded (bookies that recently failed this writer).
Rule 2: choices are random among the candidates (spreads load over the cluster), drawn from the
        injected ``random.Random`` so tests can fix them.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from polybroker.ledger.api import NotEnoughBookiesError


def choose_ensemble(
    available: Sequence[str], size: int, rng: random.Random, exclude: Collection[str] = ()
) -> tuple[str, ...]:
    """Return ``size`` distinct bookies from ``available`` minus ``exclude``.

    Raises ``NotEnoughBookiesError`` when fewer candidates exist."""
    candidates = [a for a in dict.fromkeys(available) if a not in exclude]
    if len(candidates) < size:
        raise NotEnoughBookiesError(
            f"need {size} bookies, {len(candidates)} available: {sorted(candidates)}"
        )
    return tuple(rng.sample(candidates, size))


def replace_bookies(
    ensemble: Sequence[str],
    failed: Collection[str],
    available: Sequence[str],
    rng: random.Random,
    exclude: Collection[str] = (),
) -> tuple[str, ...]:
    """Return ``ensemble`` with every member in ``failed`` swapped for a fresh bookie (Rule 1).

    Positions are kept, so the write sets of the surviving members do not move."""
    to_replace = [a for a in ensemble if a in failed]
    taken = set(ensemble) | set(exclude) | set(failed)
    fresh = list(choose_ensemble(available, len(to_replace), rng, taken))
    return tuple(fresh.pop() if a in failed else a for a in ensemble)
