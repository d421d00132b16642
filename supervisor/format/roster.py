"""The roster: which nodes of an allocation train, at which node rank, and which wait as spares
(``supervisor/roster.json``, written by the SLURM job's coordinator only, read by every node's
watchdog under ``watch --roster KEY``; docs/slurm.md#hot-spares).

Each generation is one launch of the whole group. A watchdog launches only in a generation newer
than its last one that lists its node, so a group never forms half old, half new: the coordinator
writes the next generation once every training node's watchdog waits for it or is lost, and a
spare takes a lost node's node rank (its ranks then load that node's ranks' state from the shared
run directory). ``stop``: no further generation; every waiting watchdog exits ``exit_code``.

The group itself is formed by the ranks (``GroupFacts``): each node's torchrun starts its ranks
alone (``--standalone``), and the ranks' gate (``supervisor.resumable.wait_if_standby``) sets the
global rank, world size and the master's address before ``init_process_group``. A launch started
cold gets them in ``ENV_GROUP``; a standby (started ahead, imports done) in its release file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from supervisor.format.atomic import atomic_write_json
from supervisor.format.capped import read_record
from supervisor.format.layout import RunDir

ROSTER_VERSION = 1
# Set by the watchdog for a launch under a roster: the group's facts (JSON), or RELEASED when they
# come in the standby's release file.
ENV_GROUP = "SUPERVISOR_GROUP"
RELEASED = "release"


@dataclass(frozen=True)
class GroupFacts:
    """Where one node's ranks join a generation's process group."""

    generation: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int

    def to_json(self) -> str:
        return json.dumps({"group": asdict(self)}, sort_keys=True)

    @classmethod
    def parse(cls, text: str | bytes) -> GroupFacts:
        """ValueError (a short reason) unless ``text`` is a group's facts."""
        try:
            d = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError("not valid JSON") from None
        g = d.get("group") if isinstance(d, dict) else None
        if not isinstance(g, dict):
            raise ValueError("no 'group' object")
        facts = cls(
            generation=_int(g, "generation"),
            node_rank=_int(g, "node_rank"),
            nnodes=_int(g, "nnodes"),
            master_addr=_str(g, "master_addr"),
            master_port=_int(g, "master_port"),
        )
        if (
            not 0 <= facts.node_rank < facts.nnodes
            or not 0 < facts.master_port < 65536
            or not facts.master_addr
        ):
            raise ValueError(f"group {asdict(facts)} is impossible")
        return facts

    def environ(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """The variables torch's ``env://`` rendezvous and the trainer read, for one rank; the
        store is hosted by global rank 0 (not by a torchrun agent: each node's agent is alone)."""
        rank, world = self.node_rank * local_world_size + local_rank, self.nnodes * local_world_size
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }


@dataclass(frozen=True)
class Roster:
    """One generation of the roster."""

    key: str  # the job's run it belongs to (SLURM: JOBID.RESTARTCOUNT); another key is never followed
    generation: int
    hosts: tuple[str, ...]  # the allocation's hosts, by node index (SLURM_NODEID)
    nodes: tuple[int, ...]  # the training nodes by node rank: nodes[r] is node rank r
    spares: tuple[int, ...] = ()  # waiting to replace a lost node
    master_port: int = 0
    stop: bool = False
    exit_code: int | None = None  # with stop: what every waiting watchdog exits with
    reason: str = ""  # why this generation (or the stop) was written
    replaced: Mapping[str, str] = field(default_factory=dict)  # lost or bad host -> its replacement
    written: float = 0.0
    version: int = ROSTER_VERSION

    def facts(self, node: int) -> GroupFacts | None:
        """``node``'s place in this generation; None when it does not train in it."""
        if node not in self.nodes:
            return None
        return GroupFacts(
            self.generation, self.nodes.index(node), len(self.nodes), self.master_addr, self.master_port
        )

    @property
    def master_addr(self) -> str:
        return self.hosts[self.nodes[0]] if self.nodes else ""

    def host(self, node: int) -> str:
        return self.hosts[node] if 0 <= node < len(self.hosts) else f"node {node}"

    def describe(self) -> str:
        train = ", ".join(f"{self.host(n)}" for n in self.nodes)
        spares = ", ".join(self.host(n) for n in self.spares) or "none"
        return f"generation {self.generation}: training on {train}; spares {spares}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["replaced"] = dict(self.replaced)
        return d


def _int(d: Mapping[str, Any], key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"'{key}' is {v!r:.40}, not an integer")
    return v


def _str(d: Mapping[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise ValueError(f"'{key}' is {v!r:.40}, not a string")
    return v


def _ints(d: Mapping[str, Any], key: str) -> tuple[int, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ValueError(f"'{key}' is {v!r:.60}, not a list of integers")
    return tuple(v)


def parse_roster(d: Any) -> Roster:
    """A Roster from parsed JSON; ValueError (a short reason) when it is not one."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    hosts = d.get("hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise ValueError(f"'hosts' is {hosts!r:.60}, not a list of strings")
    replaced = d.get("replaced", {})
    if not isinstance(replaced, dict) or not all(isinstance(v, str) for v in replaced.values()):
        raise ValueError(f"'replaced' is {replaced!r:.60}, not an object of strings")
    exit_code = d.get("exit_code")
    if exit_code is not None:
        exit_code = _int(d, "exit_code")
    roster = Roster(
        key=_str(d, "key"),
        generation=_int(d, "generation"),
        hosts=tuple(hosts),
        nodes=_ints(d, "nodes"),
        spares=_ints(d, "spares"),
        master_port=_int(d, "master_port"),
        stop=bool(d.get("stop", False)),
        exit_code=exit_code,
        reason=str(d.get("reason", "")),
        replaced={str(k): v for k, v in replaced.items()},
        written=float(d.get("written", 0.0)) if isinstance(d.get("written", 0.0), (int, float)) else 0.0,
        version=_int(d, "version") if "version" in d else ROSTER_VERSION,
    )
    nodes = (*roster.nodes, *roster.spares)
    if len(set(nodes)) != len(nodes) or any(not 0 <= n < len(roster.hosts) for n in nodes):
        raise ValueError(
            f"nodes {list(roster.nodes)} and spares {list(roster.spares)} are not distinct nodes of the hosts"
        )
    if roster.stop and roster.exit_code is None:
        raise ValueError("a stop without an exit code")
    return roster


def read_roster(root: str | Path) -> Roster | None:
    """The roster as it is (None when there is none); ValueError when it is garbage, OSError when
    it cannot be read."""
    return read_record(RunDir.of(root).roster, parse_roster)


def write_roster(root: str | Path, roster: Roster) -> None:
    atomic_write_json(RunDir.of(root).roster, roster.to_dict(), root)
