"""One backoff for every wait between tries: relaunches (watch/restart_policy.py), storage retries
(ioerrors.py, the trainer's resume and final save) and the remote tier's uploads (tiers/uploader.py).

Pure: the wait before try ``n`` (1-based) is ``initial_s * 2**(n-1)`` capped at ``max_s``, then
jittered two ways a caller may combine: ``spread`` draws it from ``[cap * (1 - spread), cap]``
(0.5 is "equal jitter": processes that met the same outage do not retry in lockstep), and
``jitter_s`` adds up to that many seconds before the cap. The random draws come from the caller's
``rng``: the global ``random`` belongs to the training loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float
    max_s: float
    spread: float = 0.0
    jitter_s: float = 0.0

    def wait_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before try ``attempt`` (1-based; < 1 waits nothing)."""
        if attempt < 1:
            return 0.0
        base = self.initial_s * 2.0 ** min(attempt - 1, 1024)  # no float overflow on long outages
        if self.jitter_s or self.spread:
            rng = rng or random.Random()
        if self.jitter_s:
            base += rng.uniform(0, self.jitter_s) if rng else 0.0
        cap = min(self.max_s, base)
        return rng.uniform(cap * (1 - self.spread), cap) if self.spread and rng else cap
