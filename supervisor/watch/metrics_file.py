"""``watch --metrics-file``: node_exporter's textfile kept current with the run's metrics.

A thread of the watchdog builds the run's status report every ``--metrics-interval`` seconds, as
`status` would, and replaces the file atomically (supervisor/prometheus.py): the collector never
reads half a file, and a dashboard sees the run the way an operator's `status` does. A last write
when the watchdog ends shows the final state (done, failed, stopped). A failed write is said once
per kind of failure and retried at the next tick: metrics never stop the run.
"""

from __future__ import annotations

import threading
from pathlib import Path

from supervisor.format import events


class MetricsFile(threading.Thread):
    def __init__(self, root: Path, path: Path, interval_s: float):
        super().__init__(name="metrics-file", daemon=True)
        self.root, self.path, self.interval_s = root, path, interval_s
        self._halt = threading.Event()
        self._said: set[str] = set()

    def run(self) -> None:
        while not self._halt.is_set():
            self.write()
            self._halt.wait(self.interval_s)

    def write(self) -> None:
        from supervisor.prometheus import write_textfile  # here: reports import the watch package
        from supervisor.report import build_report

        try:
            write_textfile(self.path, build_report(self.root))
        except Exception as e:  # the run goes on whatever the metrics do
            what = f"{type(e).__name__}: {e}"
            if what not in self._said:
                self._said.add(what)
                events.say(f"[supervisor] --metrics-file {self.path} not written ({what}); retried")

    def stop(self) -> None:
        """Stop the thread, then write the final state once."""
        self._halt.set()
        if self.is_alive():
            self.join()
        self.write()
