"""The ranks' gate before ``init_process_group``, for two things the watchdog may ask of a launch:

- a standby launch (``supervisor watch --standby``, or a spare under a roster): its ranks start
  and import torch ahead of a failure, then wait here, before touching the process group or the
  run directory, until the watchdog releases them (a file appears), so a relaunch skips the
  interpreter's start and the imports;
- a launch under a roster (hot spares, supervisor/format/roster.py): each node's torchrun starts
  its ranks alone, and the gate joins them to the generation's group (global rank, world size,
  the master's address) from the watchdog's facts: in the environment for a launch started cold,
  in the release file for a standby.

Importing ``supervisor.resumable`` passes the gate (a user's loop needs no call of its own, nor
does the reference trainer); a later call returns at once. Once passed, the
watchdog's variables are taken out of the environment: the rank's own children (DataLoader
workers that import the package again) must not wait, nor join a group.

Without the watchdog's variables this returns at once."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from supervisor.appear import Appearance
from supervisor.format.atomic import atomic_write_text, pid_alive
from supervisor.format.capped import RECORD_MAX, read_capped
from supervisor.format.heartbeat import ENV_STANDBY_RELEASE, ENV_WATCHDOG_PID
from supervisor.format.layout import standby_ready_filename
from supervisor.format.roster import ENV_GROUP, RELEASED, GroupFacts

# The release wakes the wait at once (inotify on its folder); these bound the rest: a check of the
# file every BACKSTOP_S (a release no local event announced), a stat every POLL_S where inotify is
# not to be had, and whether the watchdog still lives every LIVENESS_S.
BACKSTOP_S = 0.1
POLL_S = 0.005
LIVENESS_S = 1.0
# What the trainer would import lazily after the gate (measured: ~235 modules during main, most of
# them the optimizer's first step pulling in torch._dynamo): imported while waiting instead.
WARM_IMPORTS = ("torch._dynamo", "numpy.random", "filelock")


def wait_if_standby() -> None:
    """Return once released (and, under a roster, joined to the group); exit 0 if the watchdog
    that started this launch is gone (nobody will release it: a SIGKILLed watchdog must not leave
    waiting ranks behind). Call it before ``init_process_group``."""
    release = os.environ.get(ENV_STANDBY_RELEASE)
    group = os.environ.get(ENV_GROUP, "")
    if release:
        _wait(Path(release))
    if group:
        text = group if group != RELEASED else read_capped(release or "", RECORD_MAX).decode()
        join_group(GroupFacts.parse(text))
    os.environ.pop(ENV_STANDBY_RELEASE, None)
    os.environ.pop(ENV_GROUP, None)


def _wait(release: Path) -> None:
    watchdog = int(os.environ.get(ENV_WATCHDOG_PID, "0") or 0)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    ready = release.parent / standby_ready_filename(int(os.environ.get("RANK", "0")))
    atomic_write_text(ready, f"{os.getpid()}\n")  # for whoever wants to know it is ready (bench/mttr.py)
    with Appearance(release, BACKSTOP_S, POLL_S) as appearance:
        while not appearance.wait(LIVENESS_S):
            if watchdog and not pid_alive(watchdog):
                sys.exit(0)


def join_group(facts: GroupFacts) -> None:
    """This rank's place in the roster's group, in the variables ``init_process_group`` reads."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.update(facts.environ(local, local_world))
