"""A standby launch (``supervisor watch --standby``): its ranks start and import torch ahead of a
failure, then wait here, before touching the process group or the run directory, until the
watchdog releases them (a file appears), so a relaunch skips the interpreter's start and the
imports. Without the watchdog's variable set this returns at once."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

from supervisor.format.atomic import atomic_write_text, pid_alive
from supervisor.format.heartbeat import ENV_STANDBY_RELEASE, ENV_WATCHDOG_PID
from supervisor.format.layout import standby_ready_filename

POLL_S = 0.005  # a stat every 5 ms: negligible, and the release costs at most this
# What the trainer would import lazily after the gate (measured: ~235 modules during main, most of
# them the optimizer's first step pulling in torch._dynamo): imported while waiting instead.
WARM_IMPORTS = ("torch._dynamo", "numpy.random", "filelock")


def wait_if_standby() -> None:
    """Return once released; exit 0 if the watchdog that started this launch is gone (nobody
    will release it: a SIGKILLed watchdog must not leave waiting ranks behind)."""
    release = os.environ.get(ENV_STANDBY_RELEASE)
    if not release:
        return
    watchdog = int(os.environ.get(ENV_WATCHDOG_PID, "0") or 0)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    ready = Path(release).parent / standby_ready_filename(int(os.environ.get("RANK", "0")))
    atomic_write_text(ready, f"{os.getpid()}\n")  # for whoever wants to know it is ready (bench/mttr.py)
    checks = 0
    while not os.path.exists(release):
        checks += 1
        if watchdog and checks % 200 == 0 and not pid_alive(watchdog):
            sys.exit(0)
        time.sleep(POLL_S)
