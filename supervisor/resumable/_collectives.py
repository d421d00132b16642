"""The rank's side of a hang's diagnosis: what torch's flight recorder says of its collectives,
written when the watchdog asks (record and protocol: supervisor/format/collectives.py).

A hung rank's main thread is blocked (in a collective, a DataLoader, a read), so no Python code of
the training loop can answer. This thread sleeps in a read of a FIFO beside the heartbeat and
costs nothing until the watchdog writes a token into it; it then reads the flight recorder (a C++
call that takes torch's own lock, never the main thread's) and writes the summary atomically.
Started only when the launch's environment turns the flight recorder on (the watchdog does:
``watch --flight-recorder``) and the installed torch can dump it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from supervisor.format import confined
from supervisor.format.collectives import CollectiveDump, GroupState, from_flight_recorder, recorder_entries
from supervisor.format.layout import collectives_filename, collectives_request_filename

log = logging.getLogger(__name__)
THREAD = "resumable-collectives"
STOP = b"-"  # written by close(): the thread ends
_TOKEN_MAX = 64

Dump = Callable[[bool, bool], bytes | str]


def _dumpers() -> list[tuple[str, Dump]]:
    """torch's flight-recorder dumps this build has: the CPU one (gloo; torch 2.10+) and NCCL's
    (a CUDA build), each JSON text of ``{"entries", "pg_status"...}``."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    found = [
        (name, getattr(c10d, fn, None))
        for name, fn in (("", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json"))
    ]
    return [(name, fn) for name, fn in found if callable(fn)]


class CollectiveReporter:
    """Answers the watchdog's requests for this rank's collectives (``start``; ``close`` ends it)."""

    def __init__(
        self,
        folder: Path,
        within: Path,
        rank: int,
        step: Callable[[], int],
        fd: int,
        dumpers: list[tuple[str, Dump]],
    ):
        self.folder, self.within, self.rank, self.step = folder, within, rank, step
        self.fd = fd
        self.dumpers = dumpers
        self.answered = 0
        self._thread = threading.Thread(target=self._run, name=THREAD, daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls,
        folder: Path,
        within: Path,
        rank: int,
        step: Callable[[], int],
        environ: Mapping[str, str] = os.environ,
    ) -> CollectiveReporter | None:
        """A reporter for this rank (``step``: the last step it finished, read when it answers), or
        None: the flight recorder is off in this environment, this torch cannot dump it, or the
        FIFO cannot be made (one warning)."""
        dumpers = _dumpers()
        if recorder_entries(environ) <= 0 or not dumpers:
            return None
        try:
            fd = confined.make_fifo(within, folder / collectives_request_filename(rank))
        except OSError as e:
            log.warning("rank %d: no collectives on a hang (the request FIFO: %s)", rank, e)
            return None
        return cls(folder, within, rank, step, fd, dumpers)

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 4096)
            except OSError:
                return
            tokens = data.split()
            if not tokens or tokens[-1] == STOP:
                os.close(self.fd)
                return
            self.answer(tokens[-1][:_TOKEN_MAX].decode(errors="replace"))

    def answer(self, token: str) -> CollectiveDump:
        """Read the flight recorder and write the summary, tagged with ``token``."""
        groups: list[GroupState] = []
        problem = ""
        try:
            for backend, dump in self.dumpers:
                trace = json.loads(dump(True, False))
                for g in from_flight_recorder(trace):
                    groups.append(
                        g
                        if not backend
                        else GroupState(f"{g.group}:{backend}", g.desc, g.entered, g.finished, g.recent)
                    )
        except Exception as e:  # whatever torch raised, said in the answer
            problem = f"{type(e).__name__}: {e}"
        source = f"torch {torch.__version__} flight recorder"
        rec = CollectiveDump(self.rank, os.getpid(), token, source, tuple(groups), problem, self.step())
        try:
            confined.write_atomic(self.within, self.folder / collectives_filename(self.rank), rec.encode())
        except OSError as e:
            log.warning("rank %d: collectives not written (%s)", self.rank, e)
        self.answered += 1
        return rec

    def close(self) -> None:
        """End the thread (it closes the FIFO)."""
        try:
            os.write(self.fd, STOP + b"\n")
        except OSError:
            return
        self._thread.join(timeout=5)
