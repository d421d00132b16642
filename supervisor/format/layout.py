"""The run directory: names and paths, the one truth shared by the watchdog and the trainer.

    ROOT/
      step_00000050/                 committed checkpoint: DCP shards and their index (.metadata,
                                     or one __3_index.metadata per rank for sharded state), per-rank
                                     rank_00003.state.pt, manifest.json (and manifest.sig when the
                                     run signs its checkpoints)
      step_00000100.tmp.<pid>.<host>/ a checkpoint being written; never listed as a checkpoint
      step_00000020.deleting.<pid>.<host>/  a pruned checkpoint being removed; never listed
      latest                         text pointer to the newest committed checkpoint (a hint only)
      quarantine/step_..-<utc>/      checkpoints found corrupt, with reason.txt; kept for inspection
                                     (``prune``'s quarantine retention removes the oldest)
      heartbeats/rank_00003.json     per-rank liveness, from a rank run without a watchdog
      heartbeats/node_00003.json     node 3's summary, published by its watchdog: its ranks'
                                     heartbeats (written on the node, see node_heartbeat_dir)
      heartbeats/stacks_rank_00003.txt  faulthandler stack dumps of that rank
      heartbeats/collectives_rank_00003.json  its collectives from torch's flight recorder, on a
                                     hang (.fifo: where the watchdog asks for them)
      supervisor/state.json          the watchdog's state (node N > 0: state.nodeN.json)
      supervisor/events.jsonl        its event log (node N > 0: events.nodeN.jsonl)
      supervisor/events.remote.jsonl the remote-tier uploader's event log (trainer rank 0)
      supervisor/remote.json         the uploader's status
      supervisor/slurm.json          the SLURM job's requeue budget and history
      supervisor/roster.json         with hot spares: which nodes train, at which node rank, and
                                     which wait as spares (the job's coordinator writes it)
      supervisor/bad_nodes.json      the run's incidents per host and its bad-node list, with the
                                     evidence and what was done (excluded, drained)
      supervisor/events.job.jsonl    the SLURM job's coordinator's event log (nodes lost, spares
                                     swapped in, incidents, bad nodes)
      supervisor/retention.json      the retention policy the trainer prunes with (for `status`)
      supervisor/launches/<launch id>/error.json  torchelastic's root-cause error file of one launch
                                     (TORCHELASTIC_ERROR_FILE), and elastic/: torchrun's log dir
                                     (PET_LOG_DIR), holding each worker's own error.json;
                                     release: starts a standby launch's ranks (watch --standby)
      metrics.jsonl                  the trainer's per-step metrics (rank 0, across launches)
      samples/rank_00003.jsonl       with --log-samples: the sample ids each rank trained on
      final.json                     the trainer's final digest
      .lock                          the root's mutation lock (pointer, quarantine, prune)
      .download.lock                 one download from the remote tier at a time per run dir

A directory is a run directory when it holds only these names (or nothing), or at least one of
them other than ``supervisor``; anything else (a home directory, a source checkout, a single
checkpoint, a dataset) is refused by the login-node commands.

Checkpoints other trainers write are understood in a root too (supervisor/store/foreign.py), and
make it a run directory as well:

      step-30/                       torchtitan's (plain ``dcp.save``): DCP's .metadata and shards
      epoch=0-step=30.ckpt, last.ckpt  Lightning's (``torch.save``'s zip format)
      step-30.seal.json              `ckpt seal`'s record of one of them: each file's size, mtime
                                     and checksum (they have none of their own)
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

STEP_DIGITS = 8
STEP_PREFIX = "step_"
TMP_MARK = ".tmp."
DELETING_MARK = ".deleting."
LATEST = "latest"
QUARANTINE = "quarantine"
HEARTBEATS = "heartbeats"
SUPERVISOR = "supervisor"
LOCK = ".lock"
DOWNLOAD_LOCK = ".download.lock"
MANIFEST = "manifest.json"
# With a signing key (docs/security.md): the manifest's signature, written after it, listed by it never.
SIGNATURE = "manifest.sig"
REASON = "reason.txt"
# A quarantined entry being removed by retention (hidden: never listed as quarantined).
QUARANTINE_DELETING_PREFIX = ".deleting."
# In a checkpoint: DCP's pickled index, one for all (its coordinator, rank 0, writes it), or one per
# rank, ``dcp_index_filename`` (a save without DCP's plan exchange, supervisor/resumable/_dcp_index.py).
DCP_METADATA = ".metadata"
# The trainer's outputs in the root: per-step metrics (rank 0, appended across launches), final
# digest, and with --log-samples one file of sample ids per rank under SAMPLES.
METRICS = "metrics.jsonl"
FINAL = "final.json"
SAMPLES = "samples"
# Under SUPERVISOR: each watchdog's state and event log (node N > 0 adds ".nodeN"), the remote
# tier's status and events (written by the uploader in the trainer), SLURM's requeue record.
REMOTE_STATUS = "remote.json"
REMOTE_EVENTS = "events.remote.jsonl"
REQUEUE_STATE = "slurm.json"
ROSTER = "roster.json"
BAD_NODES = "bad_nodes.json"
JOB_EVENTS = "events.job.jsonl"
RETENTION = "retention.json"
# `status`'s remembered quick checks of committed checkpoints (supervisor/store/quickcache.py).
STATUS_CACHE = "status_cache.json"
# Under SUPERVISOR/LAUNCHES/<launch id>: torchelastic's error file for the launched command
# (@record writes the root-cause exception there) and torchrun's log dir, where each worker's
# @record writes its own ELASTIC_ERROR under <run id>/attempt_<n>/<local rank>/.
LAUNCHES = "launches"
ELASTIC_ERROR = "error.json"
# Under SUPERVISOR/REPLICAS: each node's replica receiver (node_NNNNN.json: memsnap.Endpoint) and the
# job's secret its handshake uses without --signing-key (key, 0600): supervisor/watch/buddy.py.
REPLICAS = "replica"
# torchelastic's variable naming a process's error file: torchrun sets it for each worker (under its
# log dir), the watchdog for the launched command; @record, and Resumable for an uncaught exception
# (supervisor/resumable/_signals.py), write the exception there.
ELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
ELASTIC_LOGS = "elastic"
# Written by the watchdog to start a standby launch's ranks (watch --standby).
RELEASE = "release"
# ... and what each of its ranks writes there once waiting, imports done (ready_rank_00001).
STANDBY_READY_PREFIX = "ready_"
# Per-rank files: heartbeats/rank_00003.json, and names of the same form elsewhere.
RANK_PREFIX = "rank_"
# A watchdog's summary of its node: heartbeats/node_00003.json.
NODE_PREFIX = "node_"
# Node-local heartbeats (docs/watchdog.md): the watchdog takes the base folder from --node-dir or
# NODE_DIR_ENV and hands each launch the exact folder in HEARTBEAT_DIR_ENV; a rank without it
# (no watchdog) writes into the run directory's heartbeats/.
NODE_DIR_ENV = "SUPERVISOR_NODE_DIR"
HEARTBEAT_DIR_ENV = "SUPERVISOR_HEARTBEAT_DIR"
SHM = "/dev/shm"
# The memory tier (supervisor/format/memsnap.py): the node-local folder its watchdog owns, handed to
# each launch's ranks in MEMORY_DIR_ENV (unset: no memory tier).
MEMORY_DIR_ENV = "SUPERVISOR_MEMORY_DIR"
# ... named memoryN (node N), beside the lock its watchdog holds for as long as it lives (memoryN.lock).
MEMORY_PREFIX = "memory"
OWNER_LOCK_SUFFIX = ".lock"

# Checkpoints of other trainers (supervisor/store/foreign.py): torchtitan's step folders, Lightning's
# files, and the sidecar `ckpt seal` writes beside either.
FOREIGN_DCP_PREFIX = "step-"
LIGHTNING_SUFFIX = ".ckpt"
SEAL_SUFFIX = ".seal.json"
_FOREIGN_DCP_RE = re.compile(rf"{re.escape(FOREIGN_DCP_PREFIX)}([0-9]+)")
_LIGHTNING_STEP_RE = re.compile(r"(?:^|[-_])step=([0-9]+)")

# DCP's one index, or a rank's own (dcp_index_filename), with the rank.
_DCP_INDEX_RE = re.compile(r"(?:__([0-9]+)_index)?" + re.escape(DCP_METADATA))
# ASCII digits only and a full match: "step_00000050\n" or non-ASCII digits are not checkpoints.
_COMMITTED_RE = re.compile(rf"{STEP_PREFIX}([0-9]{{{STEP_DIGITS}}})")
_MARKED_RE = r"{prefix}([0-9]{{{digits}}}){mark}([0-9]+)\.([A-Za-z0-9_-]+)"
_TMP_RE = re.compile(_MARKED_RE.format(prefix=STEP_PREFIX, digits=STEP_DIGITS, mark=re.escape(TMP_MARK)))
_DELETING_RE = re.compile(
    _MARKED_RE.format(prefix=STEP_PREFIX, digits=STEP_DIGITS, mark=re.escape(DELETING_MARK))
)
# quarantine/step_00000100-20261129T090320Z[-2]: the checkpoint's name, when it was moved (UTC).
_QUARANTINED_RE = re.compile(rf"({STEP_PREFIX}[0-9]{{{STEP_DIGITS}}})-([0-9]{{8}}T[0-9]{{6}}Z)(?:-([0-9]+))?")
_RESERVED = frozenset({LATEST, QUARANTINE, HEARTBEATS, SUPERVISOR, LOCK, DOWNLOAD_LOCK})
# fnmatch globs of the same names (the fault filesystem's rules match paths with them).
COMMITTED_GLOB = STEP_PREFIX + "[0-9]" * STEP_DIGITS
TMP_GLOB = f"{STEP_PREFIX}*{TMP_MARK}*"
DCP_SHARD_GLOB = "__*_*.distcp"  # every rank's shard files (``dcp_shard_filename``)


def step_dirname(step: int) -> str:
    if step < 0 or step >= 10**STEP_DIGITS:
        raise ValueError(f"step {step} out of range for {STEP_DIGITS} digits")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_committed(name: str) -> int | None:
    """Step of a committed checkpoint directory name, or None if the name is not one."""
    m = _COMMITTED_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TmpName:
    """The parts of a checkpoint-in-progress directory's name: whose it is, so a stale one can be
    told from one being written."""

    step: int
    pid: int
    host: str


def safe_host(host: str) -> str:
    """A host name as it appears in tmp and deleting directory names."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", host) or "unknown"


def launch_id(host: str, node: int, pid: int, number: int, token: str) -> str:
    """A launch's id, unique across requeues and nodes: ``vm-n0-29616-2-edc5bc`` (host, node
    index, watchdog pid, launch number, a random token); its directory name is ``safe_host`` of it."""
    return f"{host}-n{node}-{pid}-{number}-{token}"


def launch_node(dirname: str) -> int | None:
    """The node index a launch directory's name carries, or None for a name not made by
    ``launch_id`` (the host may hold dashes: the four fields after it are parsed from the right)."""
    parts = dirname.rsplit("-", 4)
    if len(parts) != 5 or not parts[1].startswith("n") or not parts[1][1:].isdigit():
        return None
    return int(parts[1][1:])


def tmp_dirname(step: int, pid: int, host: str) -> str:
    return f"{step_dirname(step)}{TMP_MARK}{pid}.{safe_host(host)}"


def deleting_dirname(step: int, pid: int, host: str) -> str:
    """Where prune renames a checkpoint before removing it, so no reader sees it half deleted."""
    return f"{step_dirname(step)}{DELETING_MARK}{pid}.{safe_host(host)}"


def _parse_marked(regex: re.Pattern[str], name: str) -> TmpName | None:
    m = regex.fullmatch(name)
    return TmpName(int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def parse_tmp(name: str) -> TmpName | None:
    return _parse_marked(_TMP_RE, name)


def parse_deleting(name: str) -> TmpName | None:
    return _parse_marked(_DELETING_RE, name)


def quarantined_dirname(name: str, stamp: str, n: int = 1) -> str:
    """``step_00000100-20261129T090320Z``; ``-2``, ``-3``... when that name is taken."""
    return f"{name}-{stamp}" if n == 1 else f"{name}-{stamp}-{n}"


@dataclass(frozen=True)
class QuarantinedName:
    """The parts of a quarantine entry's name: the step it held and when it was moved aside."""

    step: int
    stamp: str  # %Y%m%dT%H%M%SZ, UTC: sorts in time order
    n: int

    @property
    def order(self) -> tuple[str, int]:
        """When it was moved: oldest first when sorted."""
        return (self.stamp, self.n)


def parse_quarantined(name: str) -> QuarantinedName | None:
    """The parts of a quarantine entry's name, or None for a name this layout did not make."""
    m = _QUARANTINED_RE.fullmatch(name)
    if m is None:
        return None
    step = parse_committed(m.group(1))
    assert step is not None
    return QuarantinedName(step, m.group(2), int(m.group(3) or 1))


def is_run_dir_name(name: str) -> bool:
    """True for every name this layout puts directly under a root."""
    return (
        name in _RESERVED
        or parse_committed(name) is not None
        or parse_tmp(name) is not None
        or parse_deleting(name) is not None
    )


def looks_like_run_dir(names: list[str]) -> bool:
    """Every visible entry is one of ours, or one of them is a name only a run directory has
    (another trainer's checkpoint counts: ``is_foreign_name``). ``supervisor`` alone is weak
    evidence (a source checkout has one); hidden files are ignored."""
    visible = [n for n in names if not n.startswith(".")]
    return all(is_run_dir_name(n) for n in visible) or any(
        (is_run_dir_name(n) and n != SUPERVISOR) or is_foreign_name(n) for n in names
    )


def parse_foreign_dcp(name: str) -> int | None:
    """The step of a torchtitan checkpoint folder name (``step-30``), or None."""
    m = _FOREIGN_DCP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def is_lightning_ckpt(name: str) -> bool:
    return name.endswith(LIGHTNING_SUFFIX) and len(name) > len(LIGHTNING_SUFFIX)


def lightning_step(name: str) -> int | None:
    """The step Lightning's default file name carries (``epoch=0-step=30.ckpt``), or None
    (``last.ckpt``, a custom template: the step is then read from the file)."""
    m = _LIGHTNING_STEP_RE.search(name.removesuffix(LIGHTNING_SUFFIX))
    return int(m.group(1)) if m else None


def seal_filename(name: str) -> str:
    """The sidecar `ckpt seal` writes beside another trainer's checkpoint ``name``."""
    return name + SEAL_SUFFIX


def is_foreign_name(name: str) -> bool:
    """Another trainer's checkpoint, or the seal of one."""
    return parse_foreign_dcp(name) is not None or is_lightning_ckpt(name) or name.endswith(SEAL_SUFFIX)


def _rank_name(rank: int) -> str:
    return f"{RANK_PREFIX}{rank:05d}"


def heartbeat_filename(rank: int) -> str:
    return f"{_rank_name(rank)}.json"


def parse_heartbeat_filename(name: str) -> int | None:
    """The rank of a heartbeat file name, or None for any other name."""
    digits = name[len(RANK_PREFIX) : -len(".json")]
    ok = name.startswith(RANK_PREFIX) and name.endswith(".json") and digits.isdigit()
    return int(digits) if ok else None


def node_summary_filename(node: int) -> str:
    return f"{NODE_PREFIX}{node:05d}.json"


def parse_node_summary_filename(name: str) -> int | None:
    """The node of a summary file name, or None for any other name."""
    digits = name[len(NODE_PREFIX) : -len(".json")]
    ok = name.startswith(NODE_PREFIX) and name.endswith(".json") and digits.isdigit()
    return int(digits) if ok else None


def node_local_base(environ: Mapping[str, str] = os.environ) -> Path:
    """Where node-local heartbeats go by default: $SUPERVISOR_NODE_DIR, else /dev/shm (memory:
    a write costs no disk or network), else $TMPDIR, else /tmp."""
    if environ.get(NODE_DIR_ENV):
        return Path(environ[NODE_DIR_ENV])
    if os.access(SHM, os.W_OK | os.X_OK):
        return Path(SHM)
    return Path(environ.get("TMPDIR") or "/tmp")


def node_heartbeat_dir(base: str | Path, root: str | Path, node: int, job: str) -> Path:
    """``BASE/supervisor-UID/JOB-RUNHASH/nodeN``: one folder per user, job (SLURM_JOB_ID, or
    ``local``), run directory and node, so two runs, jobs or watchdogs on one machine never
    share one; tools on the node find a run's folders by the hash of its root."""
    return Path(base) / f"supervisor-{os.getuid()}" / f"{job}-{run_key(root)}" / f"node{node}"


def node_memory_dir(base: str | Path, root: str | Path, node: int, job: str) -> Path:
    """``BASE/supervisor-UID/JOB-RUNHASH/memoryN``: the memory tier's snapshots of node N, beside its
    heartbeat folder (``node_heartbeat_dir``), with the same owner and the same lifetime."""
    return node_heartbeat_dir(base, root, node, job).with_name(f"{MEMORY_PREFIX}{node}")


def is_memory_dirname(name: str) -> bool:
    """A memory tier's folder name (``memoryN``); not its lock, nor anything else."""
    digits = name[len(MEMORY_PREFIX) :]
    return name.startswith(MEMORY_PREFIX) and digits.isdigit()


def owner_lock(folder: str | Path) -> Path:
    """Beside a node-local folder: the lock its watchdog holds (supervisor/watch/memory_owner.py)."""
    folder = Path(folder)
    return folder.with_name(folder.name + OWNER_LOCK_SUFFIX)


def run_key(root: str | Path) -> str:
    """A run directory's key in node-local paths: a hash of its absolute path."""
    import hashlib  # here: `status` imports this module and never needs it

    return hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:16]


def job_key(environ: Mapping[str, str] = os.environ) -> str:
    """The job's part of a node-local path: SLURM's job id, or ``local`` outside SLURM."""
    return safe_host(environ.get("SLURM_JOB_ID") or "local")


# A rank's faulthandler dumps every thread's stack on this signal (registered without SA_NODEFER,
# so the kernel blocks it in the thread that runs the handler until the dump is written: how the
# watchdog knows a dump is whole, supervisor/watch/process.py).
STACK_DUMP_SIGNAL = signal.SIGUSR2


def stack_dump_filename(rank: int) -> str:
    return f"stacks_{_rank_name(rank)}.txt"


def collectives_filename(rank: int) -> str:
    """Beside the rank's heartbeat: its collectives as its flight recorder saw them, written on
    the watchdog's request (supervisor/format/collectives.py)."""
    return f"collectives_{_rank_name(rank)}.json"


def collectives_request_filename(rank: int) -> str:
    """Beside the rank's heartbeat: the FIFO the rank's dump thread reads the watchdog's requests from."""
    return f"collectives_{_rank_name(rank)}.fifo"


def is_collectives_request(path: str) -> bool:
    """A rank's request FIFO (its thread always sleeps in a read of it: no storage it waits on)."""
    name = os.path.basename(path)
    return name.startswith(f"collectives_{RANK_PREFIX}") and name.endswith(".fifo")


def dcp_shard_prefix(rank: int) -> str:
    """What every shard file rank ``rank`` writes starts with (torch 2.13 ``FileSystemWriter``:
    the prefix its global plan gives)."""
    return f"__{rank}_"


def dcp_shard_filename(rank: int, index: int = 0) -> str:
    """The ``index``-th shard file rank ``rank`` writes, as DCP names them (``dcp_shard_prefix``,
    then a file count; the trainer's writer, one thread, writes one: index 0)."""
    return f"{dcp_shard_prefix(rank)}{index}.distcp"


def dcp_index_filename(rank: int | None = None) -> str:
    """DCP's pickled index: the checkpoint's one (``rank`` None), or the one ``rank`` writes when
    every rank saves alone (torch 2.13 ``FileSystemWriter`` with ``use_collectives=False``).

    Not DCP's own name for it, ``__3.metadata``: without a ``.metadata``, torch's ``dcp.load``
    (and this toolkit before it wrote these) falls back to a rank's own index without checking
    that it holds what the rank loads, which on another layout loads part of a tensor and says
    nothing (measured: docs/trainer.md). Under this name they find no index and fail loudly."""
    return DCP_METADATA if rank is None else f"__{rank}_index{DCP_METADATA}"


# The files of a checkpoint one rank writes: its shards, its own index, its per-rank state.
_RANK_FILE_RE = re.compile(r"__([0-9]+)_(?:[0-9]+\.distcp|index\.metadata)|rank_([0-9]+)\.state\.pt")


def file_rank(name: str) -> int | None:
    """The rank whose own file ``name`` (relative to its checkpoint) is, by the names above:
    ``__3_0.distcp``, ``__3_index.metadata``, ``rank_00003.state.pt``; None for another name."""
    m = _RANK_FILE_RE.fullmatch(name)
    return None if m is None else int(m.group(1) or m.group(2))


def is_dcp_index(name: str) -> bool:
    """``name`` (relative to the checkpoint) is one of DCP's pickled indexes."""
    return _DCP_INDEX_RE.fullmatch(name) is not None


def rank_state_filename(rank: int) -> str:
    """The file in a checkpoint that holds one rank's own state (its RNGs)."""
    return f"{_rank_name(rank)}.state.pt"


def samples_filename(rank: int) -> str:
    return f"{_rank_name(rank)}.jsonl"


def _node_suffix(node: int) -> str:
    return "" if node == 0 else f".node{node}"


def standby_ready_filename(rank: int) -> str:
    """What a standby launch's rank writes in its launch dir once it waits, imports done."""
    return f"{STANDBY_READY_PREFIX}{_rank_name(rank)}"


def state_filename(node: int = 0) -> str:
    return f"state{_node_suffix(node)}.json"


def parse_state_filename(name: str) -> int | None:
    """The node of a watchdog's state file name (``state.json`` 0, ``state.node3.json`` 3)."""
    if name == state_filename(0):
        return 0
    digits = name[len("state.node") : -len(".json")]
    ok = name.startswith("state.node") and name.endswith(".json") and digits.isdigit()
    return int(digits) if ok else None


def events_filename(node: int = 0) -> str:
    return f"events{_node_suffix(node)}.jsonl"


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run's checkpoint root."""

    root: Path

    @classmethod
    def of(cls, root: str | Path) -> RunDir:
        return cls(Path(root))

    @property
    def latest(self) -> Path:
        return self.root / LATEST

    @property
    def quarantine(self) -> Path:
        return self.root / QUARANTINE

    @property
    def heartbeats(self) -> Path:
        return self.root / HEARTBEATS

    @property
    def supervisor(self) -> Path:
        return self.root / SUPERVISOR

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    @property
    def download_lock(self) -> Path:
        return self.root / DOWNLOAD_LOCK

    def checkpoint(self, step: int) -> Path:
        return self.root / step_dirname(step)

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / heartbeat_filename(rank)

    def node_summary(self, node: int) -> Path:
        return self.heartbeats / node_summary_filename(node)

    def stack_dump(self, rank: int) -> Path:
        return self.heartbeats / stack_dump_filename(rank)

    def state(self, node: int = 0) -> Path:
        return self.supervisor / state_filename(node)

    def events(self, node: int = 0) -> Path:
        return self.supervisor / events_filename(node)

    @property
    def remote_status(self) -> Path:
        return self.supervisor / REMOTE_STATUS

    @property
    def remote_events(self) -> Path:
        return self.supervisor / REMOTE_EVENTS

    def replica_endpoint(self, node: int) -> Path:
        """Where node ``node``'s watchdog says its replica receiver listens (memsnap.Endpoint)."""
        return self.supervisor / REPLICAS / f"node_{node:05d}.json"

    @property
    def replica_key(self) -> Path:
        """The job's secret for the replica's handshake when no --signing-key is given (0600)."""
        return self.supervisor / REPLICAS / "key"

    def launch_dir(self, launch_id: str) -> Path:
        """One launch's own files (the id as tmp names spell hosts: nothing but [A-Za-z0-9_-])."""
        return self.supervisor / LAUNCHES / safe_host(launch_id)

    def error_file(self, launch_id: str) -> Path:
        return self.launch_dir(launch_id) / ELASTIC_ERROR

    def elastic_logs(self, launch_id: str) -> Path:
        return self.launch_dir(launch_id) / ELASTIC_LOGS

    def release_file(self, launch_id: str) -> Path:
        return self.launch_dir(launch_id) / RELEASE

    @property
    def requeue_state(self) -> Path:
        return self.supervisor / REQUEUE_STATE

    @property
    def roster(self) -> Path:
        return self.supervisor / ROSTER

    @property
    def bad_nodes(self) -> Path:
        return self.supervisor / BAD_NODES

    @property
    def job_events(self) -> Path:
        return self.supervisor / JOB_EVENTS

    @property
    def retention(self) -> Path:
        return self.supervisor / RETENTION

    @property
    def status_cache(self) -> Path:
        return self.supervisor / STATUS_CACHE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def final(self) -> Path:
        return self.root / FINAL

    def samples(self, rank: int) -> Path:
        return self.root / SAMPLES / samples_filename(rank)


def per_node_files(folder: str, parse: Callable[[str], int | None]) -> list[tuple[int, str]]:
    """(node, path) of each file in ``folder`` whose name ``parse`` gives a node, by node; none when
    the folder cannot be listed. Plain strings (os.listdir, f-strings, no os.path.join or Path):
    `status` lists 2,048 summaries and 2,048 state files this way, and those cost it ms."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = ((parse(n), n) for n in names)
    return sorted((node, f"{folder}/{n}") for node, n in found if node is not None)
