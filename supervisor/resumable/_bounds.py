"""How long a rank may wait on its own, below the watchdog's phase timeouts.

The watchdog judges a rank by its progress: a rank that waits (for its peers in a collective, for a
backoff) makes none, and past its phase's timeout it is hung. A wait that the rank bounds itself,
well under that timeout, ends first: a collective that times out raises, the launch fails fast
and is relaunched, instead of sitting in a collective its peers never enter (ranks that went
different ways after a failed save) until the watchdog's verdict, or forever without one.

The watchdog passes its phase timeouts to every launch (``ENV_PHASE_TIMEOUTS``); a rank started
without one bounds its waits under the defaults, which are the watchdog's too.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from datetime import timedelta

from supervisor.format.heartbeat import (
    DEFAULT_COMMIT_TIMEOUT_S,
    DEFAULT_SAVE_TIMEOUT_S,
    ENV_PHASE_TIMEOUTS,
    Phase,
)

log = logging.getLogger(__name__)

# A wait a rank bounds itself gives up after this share of the shortest phase timeout it may run
# under: a mismatch is a crash (and a relaunch) at half the time the watchdog would allow.
WAIT_SHARE = 0.5
_DEFAULTS = {Phase.SAVE: DEFAULT_SAVE_TIMEOUT_S, Phase.COMMIT: DEFAULT_COMMIT_TIMEOUT_S}


def phase_timeouts(environ: Mapping[str, str] = os.environ) -> dict[Phase, float]:
    """The save and commit timeouts of the watchdog that launched this rank (the defaults without
    one, or, with a warning, when its value cannot be read)."""
    out = dict(_DEFAULTS)
    raw = environ.get(ENV_PHASE_TIMEOUTS, "")
    if not raw:
        return out
    try:
        given = json.loads(raw)
        for phase in out:
            value = given.get(phase.value, out[phase]) if isinstance(given, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{phase.value}: {value!r}")
            out[phase] = float(value)
    except ValueError as e:  # JSONDecodeError is one
        log.warning(
            "$%s=%r unreadable (%s): waits bounded under the default timeouts", ENV_PHASE_TIMEOUTS, raw, e
        )
        return dict(_DEFAULTS)
    return out


def wait_bound_s(*phases: Phase, environ: Mapping[str, str] = os.environ) -> float:
    """Seconds a wait that may happen in any of ``phases`` gives up after: WAIT_SHARE of the
    shortest of their timeouts."""
    timeouts = phase_timeouts(environ)
    return WAIT_SHARE * min(timeouts[p] for p in phases)


def as_timedelta(seconds: float) -> timedelta:
    """For ``dist.new_group(timeout=...)``."""
    return timedelta(seconds=seconds)
