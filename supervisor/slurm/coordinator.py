"""The SLURM job's coordinator (``python -m supervisor slurm coordinate``, run by sbatch/job.sh beside
srun in the batch shell): it watches every node of the allocation through the run directory
(each node's summary, each watchdog's event log) and SLURM (``scontrol show node``), finds lost
nodes, pins failures on hosts (``incidents.py``) and keeps the run's bad-node list
(supervisor/format/badnodes.py). With SPARE_NODES (or --standby in WATCH_OPTS: ``Knobs.rostered``)
it also writes the roster (``spares.py``): the first generation at once, then the next one whenever
every training node waits for it or is lost, a spare in each lost (or bad) node's place; and it
ends the job: once every node that is not lost
has its watchdog ended, it prints the job's exit code and exits with it (srun cannot say it while
it waits for a lost node's task).

Thin: facts in, pure decisions (spares, incidents), records and events out. Its events go to
``supervisor/events.job.jsonl`` and to the job's output.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from supervisor.format import eventtypes as ev
from supervisor.format.badnodes import Action, BadNodes, Incident, read_bad_nodes, write_bad_nodes
from supervisor.format.events import EventLog, follow_events
from supervisor.format.layout import RunDir
from supervisor.format.nodesummary import SummaryHeader, read_summary, summary_paths
from supervisor.format.roster import Roster, write_roster
from supervisor.slurm import incidents, spares
from supervisor.slurm.env import BAD_NODE, JobEnv, Knobs
from supervisor.slurm.launch import default_rdzv_port, roster_key
from supervisor.slurm.scontrol import scontrol_records

TICK_S = 0.2
SLURM_POLL_S = 10.0
SLURM_TIMEOUT_S = 10.0
# Without a roster, an episode's evidence is complete once nothing new came for the node timeout
# (a lost node is found that late) plus this.
QUIET_EXTRA_S = 5.0

Say = Callable[[str], None]


def _signature(h: SummaryHeader) -> tuple[float, float, int]:
    return (h.wall_time, h.mono_time, h.watchdog_pid)


class Coordinator:
    def __init__(self, job: JobEnv, knobs: Knobs, hosts: Sequence[str]) -> None:
        self.job, self.knobs, self.hosts = job, knobs, list(hosts)
        self.root = knobs.run_dir
        self.run = RunDir.of(self.root)
        self.key = roster_key(job)
        self.with_roster = knobs.rostered(job)
        self.log = EventLog(self.root, echo=sys.stdout, path=self.run.job_events)
        self.started = time.monotonic()
        self.views = {n: spares.NodeView(n, h, silent_s=0.0) for n, h in enumerate(self.hosts)}
        self._sig: dict[int, tuple[float, float, int]] = {}  # each summary's signature last read
        self._changed: dict[int, float] = {}  # when it last changed (time.monotonic)
        self._earlier = {n: _signature(h) for n, h in self._summaries().items()}  # an earlier run's: not ours
        self._offsets = {n: self._size(n) for n in range(len(self.hosts))}  # their events: theirs
        self.lost: dict[int, str] = {}
        self.failures: list[incidents.Failure] = []  # the open episode's evidence
        self._episode_lost: set[str] = set()
        self._last_failure = 0.0
        self._slurm_at = 0.0
        self._slurm_down: dict[str, str] = {}
        self.bad = self._load_bad()
        self.roster: Roster | None = None

    # ------------------------------------------------------------ the loop

    def coordinate(self) -> int:
        """Until the job is over: its exit code."""
        for sig in (signal.SIGUSR1, signal.SIGURG):  # the notice is the watchdogs' business
            signal.signal(sig, signal.SIG_IGN)
        stopping: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
        if self.with_roster:
            train = self.knobs.train_nodes(self.job)
            self._write(spares.first_roster(self.key, self.hosts, train, set(self.bad.bad), self._port()))
        while True:
            self._observe()
            if stopping:  # the job script is done with it (srun ended): the open episode judged
                self._close_episode(time.time())
                return 128 + stopping[0]
            code = self._step()
            if code is not None:
                self.log.emit(
                    ev.JobExit(exit_code=code), f"every live node's watchdog has ended: job exit {code}"
                )
                return code
            time.sleep(TICK_S)

    def _step(self) -> int | None:
        now = time.time()
        for n, why in spares.lost_now(self.views, self.lost, self.knobs.node_timeout_s).items():
            self.lost[n] = why
            self._episode_lost.add(self.hosts[n])
            self.log.emit(
                ev.NodeLost(node=n, host=self.hosts[n]), f"node {self.hosts[n]} (node {n}) lost: {why}"
            )
            self._incident(incidents.lost_incident(self.hosts[n], why, self.key, now))
        if self.roster is None:
            if (
                self.failures
                and time.monotonic() - self._last_failure >= self.knobs.node_timeout_s + QUIET_EXTRA_S
            ):
                self._close_episode(now)
            return spares.job_exit(self.views, self.lost)
        if self._generation_ended():
            self._close_episode(now)  # before the next generation: a node bad from now on is left out
        nxt = spares.next_roster(self.roster, self.views, self.lost, set(self.bad.bad))
        if nxt is not None:
            self._write(nxt)
        return spares.job_exit(self.views, self.lost)

    def _generation_ended(self) -> bool:
        r = self.roster
        if r is None or r.stop:
            return False
        return all(
            n in self.lost or self.views[n].exited or self.views[n].roster_wait > r.generation
            for n in r.nodes
        )

    # ------------------------------------------------------------ facts

    def _observe(self) -> None:
        now = time.monotonic()
        for n, header in self._summaries().items():
            sig = _signature(header)
            if n not in self._sig and sig == self._earlier.get(n):
                continue  # an earlier run's summary, until this run's watchdog writes its own
            if sig != self._sig.get(n):
                self._sig[n], self._changed[n] = sig, now
            self.views[n] = spares.NodeView(
                node=n,
                host=self.hosts[n],
                seen=True,
                status=header.status,
                exit_code=header.exit_code,
                reason=header.reason,
                role=header.role,
                roster_gen=header.roster_gen,
                roster_wait=header.roster_wait,
            )
        if now - self._slurm_at >= SLURM_POLL_S:
            self._slurm_at = now
            records = scontrol_records("node", ",".join(self.hosts), SLURM_TIMEOUT_S) or []
            self._slurm_down = incidents.slurm_states({r.get("NodeName", ""): r for r in records}, self.hosts)
        for n, v in self.views.items():
            silent = now - self._changed.get(n, self.started)
            self.views[n] = replace(v, silent_s=silent, slurm_down=self._slurm_down.get(v.host, ""))
        self._read_events()

    def _summaries(self) -> dict[int, SummaryHeader]:
        out = {}
        for n, path in summary_paths(self.root):
            if n >= len(self.hosts):
                continue
            try:
                out[n] = read_summary(path).header
            except (OSError, ValueError):
                continue  # being replaced, or garbage: its watchdog's next write says more
        return out

    def _size(self, node: int) -> int:
        try:
            return os.stat(self.run.events(node)).st_size
        except OSError:
            return 0

    def _read_events(self) -> None:
        for n, host in enumerate(self.hosts):
            evs, self._offsets[n] = follow_events(self.run.events(n), self._offsets[n])
            for logged in filter(None, map(ev.parse, evs)):  # typed; a line of another shape is no evidence
                f = incidents.failure_of(host, logged)
                if f is not None:
                    self.failures.append(f)
                    self._last_failure = time.monotonic()
                if self.knobs.straggler_action == BAD_NODE:
                    inc = incidents.straggler_incident(logged, self.key, time.time())
                    if inc is not None:
                        self._incident(inc)

    def _port(self) -> int:
        return self.knobs.rdzv_port or default_rdzv_port(self.job.job_id)

    # ------------------------------------------------------------ records

    def _load_bad(self) -> BadNodes:
        try:
            bad = read_bad_nodes(self.root)
        except (OSError, ValueError) as e:
            self.log.emit(ev.BadNodesUnreadable(), f"bad-node list not readable ({e}); starting an empty one")
            bad = None
        return replace(bad or BadNodes(), threshold=self.knobs.bad_node_incidents)

    def _save_bad(self) -> None:
        try:
            write_bad_nodes(self.root, self.bad)
        except OSError as e:
            self.log.emit(ev.BadNodesUnreadable(), f"bad-node list not written ({e}); kept in memory")

    def _incident(self, inc: Incident) -> None:
        was_bad = inc.host in self.bad.bad
        self.bad, new = self.bad.add(inc)
        self._save_bad()
        if not new:
            return
        count = len(self.bad.of(inc.host))
        self.log.emit(
            ev.Incident(host=inc.host, why=list(inc.why), count=count),
            f"incident {count} of {inc.host}: {inc.describe()}",
        )
        if not was_bad and inc.host in self.bad.bad:
            self.log.emit(
                ev.BadNode(host=inc.host, count=count),
                f"{inc.host} is a bad node ({count} incidents, threshold {self.bad.threshold}): left out of the "
                "next launch when a spare can take its place, excluded from a requeue",
            )

    def _close_episode(self, now: float) -> None:
        for inc in incidents.attribute(self.failures, self._episode_lost, self.key, now):
            self._incident(inc)
        self.failures, self._episode_lost = [], set()

    def _write(self, roster: Roster) -> None:
        write_roster(self.root, roster)
        self.roster = roster
        if roster.stop:
            self.log.emit(
                ev.Generation(generation=roster.generation, stop=True, exit_code=roster.exit_code),
                f"roster: stop, exit {roster.exit_code}: {roster.reason}",
            )
            return
        self.log.emit(
            ev.Generation(
                generation=roster.generation,
                nodes=[self.hosts[n] for n in roster.nodes],
                spares=[self.hosts[n] for n in roster.spares],
                replaced=dict(roster.replaced),
            ),
            f"roster {roster.describe()} ({roster.reason})",
        )
        left_out = sorted(
            h
            for h in self.bad.bad
            if h in self.hosts and self.hosts.index(h) not in (*roster.nodes, *roster.spares)
        )
        if left_out and (not self.bad.actions or self.bad.actions[-1].hosts != tuple(left_out)):
            self.bad = self.bad.did(Action("left out", tuple(left_out), self.key, time.time(), roster.reason))
            self._save_bad()
