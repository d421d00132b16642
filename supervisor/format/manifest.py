"""manifest.json: what a committed checkpoint must contain, and the checksum that proves it.

The manifest is the last file written into a checkpoint; its presence with every listed file at
the listed size is the commit marker. Format 2 adds ``writers`` (which rank wrote which files), so
a checkpoint one rank's files never reached is refused at commit and caught by validation; format
1 manifests stay readable (without that check). Checksum: xxh3-128. Measured here on 256 MiB in memory
(bench/verify.py, docs/measured.md): xxh3-128 14.3 GB/s, crc32c 12.1, zlib.crc32 2.2, sha256 1.2, blake2b 0.9.
At >10x a disk's read speed, verifying costs little more than reading.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from supervisor.errors import IntegrityError
from supervisor.format import confined
from supervisor.format.capped import TooLarge, regular_only
from supervisor.format.layout import MANIFEST, SIGNATURE

FORMAT_VERSION = 2
READABLE_VERSIONS = frozenset({1, 2})
CHECKSUM_ALGO = "xxh3_128"
READ_CHUNK = 8 << 20
# Files hashed at once by checksum_files: reads and xxhash's update both release the GIL, so one
# thread's read overlaps another's hashing (bench/verify.py, docs/checksum.md).
VERIFY_THREADS = min(8, os.cpu_count() or 1)

ProgressFn = Callable[[int], None]
# A ``meta`` key (optional; the reference trainer writes it): seconds from the save call to the
# commit on rank 0's clock, an async save's wait for its commit step boundary included. `slurm
# start` compares the newest one with the job's --signal lead time.
META_SAVE_S = "save_s"
# A ``meta`` key (optional; Resumable writes it): the last losses the loop reported, oldest first,
# for the resume's sanity step (supervisor/resumable/_sanity.py).
META_RECENT_LOSSES = "recent_losses"
# Files of a checkpoint its manifest does not list: itself, and the signature written after it.
NOT_LISTED = frozenset({MANIFEST, SIGNATURE})


class ManifestError(IntegrityError, ValueError):
    """The manifest is missing, unreadable or not of a known schema; the message says which."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as committed: what a quick check (size) and a deep one (checksum)
    compare against."""

    size: int
    checksum: str


@dataclass(frozen=True)
class CheckpointInfo:
    """What a manifest records about its checkpoint besides the files: one record from the
    trainer to ``commit``, and from a remote manifest to the commit of its download."""

    step: int
    world_size: int
    model_config_hash: str = ""
    data_fingerprint: str = ""
    parallelism: Mapping[str, Any] = field(default_factory=dict)
    torch_version: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)
    # The training metrics of the saved step (e.g. {"loss": 2.31}): what best-metric retention
    # ranks by (supervisor/store/retention.py). Empty: not recorded (older manifests read as empty).
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint's record of itself: every file with its size and checksum, who wrote
    it, and what the run was (config hash, data fingerprint, parallelism)."""

    step: int
    world_size: int
    files: Mapping[str, FileEntry]
    model_config_hash: str = ""
    data_fingerprint: str = ""
    parallelism: Mapping[str, Any] = field(default_factory=dict)
    torch_version: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    wall_time: float = 0.0
    # rank -> the files it wrote (format 2); empty: not recorded (format 1, or a commit that did
    # not report them), so rank coverage is not checked.
    writers: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algo: str = CHECKSUM_ALGO

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    @property
    def info(self) -> CheckpointInfo:
        return CheckpointInfo(**{f.name: getattr(self, f.name) for f in fields(CheckpointInfo)})

    def to_json(self) -> str:
        # Not asdict(self): it deep-copies every entry, seconds for 4,096 ranks' files.
        d = asdict(replace(self, files={}, writers={}))
        d["files"] = {k: dict(vars(v)) for k, v in sorted(self.files.items())}
        d["writers"] = {str(r): sorted(names) for r, names in sorted(self.writers.items())}
        if self.format_version == 1:
            del d["writers"]
        return json.dumps(d, indent=1, sort_keys=True) + "\n"


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format_version": int,
    "checksum_algo": str,
    "step": int,
    "world_size": int,
    "files": dict,
    "model_config_hash": str,
    "data_fingerprint": str,
    "parallelism": dict,
    "torch_version": str,
    "meta": dict,
    "wall_time": (int, float),
}


def parse_manifest(text: str | bytes) -> Manifest:
    """Parse and schema-check a manifest; raise ManifestError with a reason a person can act on."""
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: garbage like "[[[[..."
        raise ManifestError(f"{MANIFEST} is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(d, dict):
        raise ManifestError(f"{MANIFEST} is not a JSON object")
    for key, typ in _REQUIRED.items():
        if key not in d:
            raise ManifestError(f"{MANIFEST} lacks field '{key}'")
        if not isinstance(d[key], typ) or isinstance(d[key], bool):
            raise ManifestError(f"{MANIFEST} field '{key}' has the wrong type")
    if d["format_version"] not in READABLE_VERSIONS:
        raise ManifestError(
            f"{MANIFEST} format_version {d['format_version']} is unknown "
            f"(this tool reads {', '.join(map(str, sorted(READABLE_VERSIONS)))})"
        )
    if d["checksum_algo"] != CHECKSUM_ALGO:
        raise ManifestError(f"{MANIFEST} checksum '{d['checksum_algo']}' is unknown")
    files: dict[str, FileEntry] = {}
    for name, entry in d["files"].items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and not isinstance(entry["size"], bool)
            and entry["size"] >= 0
            and isinstance(entry.get("checksum"), str)
        )
        if not ok or not _is_safe_relpath(name) or name in NOT_LISTED:
            raise ManifestError(f"{MANIFEST} entry '{name}' is malformed")
        files[name] = FileEntry(entry["size"], entry["checksum"])
    writers = _parse_writers(d) if d["format_version"] >= 2 else {}
    problem = writers_problem(writers, d["world_size"], {n: e.size for n, e in files.items()})
    if problem:
        raise ManifestError(f"{MANIFEST}: {problem}")
    return Manifest(
        step=d["step"],
        world_size=d["world_size"],
        files=files,
        model_config_hash=d["model_config_hash"],
        data_fingerprint=d["data_fingerprint"],
        parallelism=d["parallelism"],
        torch_version=d["torch_version"],
        meta=d["meta"],
        metrics=_parse_metrics(d),
        wall_time=float(d["wall_time"]),
        writers=writers,
        format_version=d["format_version"],
        checksum_algo=d["checksum_algo"],
    )


def _parse_metrics(d: Mapping[str, Any]) -> dict[str, float]:
    """``metrics``: ``{"<name>": number}``; absent in manifests written before it existed."""
    raw = d.get("metrics", {})
    ok = isinstance(raw, dict) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in raw.values()
    )
    if not ok:
        raise ManifestError(f"{MANIFEST} field 'metrics' is not an object of numbers")
    return {k: float(v) for k, v in raw.items()}


def _parse_writers(d: Mapping[str, Any]) -> dict[int, tuple[str, ...]]:
    """Format 2's ``writers``: ``{"<rank>": [relative paths]}``, schema only (coverage is
    ``writers_problem``'s)."""
    raw = d.get("writers")
    if not isinstance(raw, dict):
        raise ManifestError(f"{MANIFEST} field 'writers' is missing or has the wrong type")
    out: dict[int, tuple[str, ...]] = {}
    for key, names in raw.items():
        ok = (
            isinstance(key, str)
            and key.isascii()
            and key.isdigit()
            and str(int(key)) == key
            and isinstance(names, list)
            and all(isinstance(n, str) for n in names)
        )
        if not ok:
            raise ManifestError(f"{MANIFEST} writers entry '{key}' is malformed")
        out[int(key)] = tuple(names)
    return out


def writers_problem(
    writers: Mapping[int, Collection[str]],
    world_size: int,
    present: Mapping[str, int],
    reported: Mapping[str, FileEntry] | None = None,
) -> str:
    """Why ``writers`` does not describe a complete checkpoint, or '' when it does (or is empty:
    not recorded). Complete: every rank of ``world_size`` wrote at least one file, no other rank
    is named, and every file a rank wrote is ``present`` (name -> size), at the size the rank
    ``reported`` when it reported one."""
    if not writers:
        return ""
    outside = sorted(r for r in writers if not 0 <= r < world_size)
    if outside:
        return f"rank {outside[0]} is outside world size {world_size}"
    for rank in range(world_size):
        if not writers.get(rank):
            return f"rank {rank} of world size {world_size} wrote no files"
    for rank, names in sorted(writers.items()):
        for name in sorted(names):
            if name not in present:
                return f"{name} written by rank {rank} is missing"
            entry = (reported or {}).get(name)
            if entry is not None and entry.size != present[name]:
                return (
                    f"{name} written by rank {rank} is {present[name]} bytes, rank {rank} wrote {entry.size}"
                )
    return ""


def read_manifest(ckpt_dir: str | Path) -> Manifest:
    path = Path(ckpt_dir) / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{MANIFEST} is missing") from None
    except OSError as e:
        raise ManifestError(f"{MANIFEST} is unreadable ({e.strerror})") from None
    return parse_manifest(data)


def _is_safe_relpath(name: str) -> bool:
    return bool(name) and not name.startswith("/") and ".." not in name.split("/") and "\\" not in name


def _hasher(algo: str) -> Any:
    """A fresh hash object: xxh3-128 (the manifest's checksum) or any hashlib algorithm."""
    if algo == CHECKSUM_ALGO:
        import xxhash  # here: listing and quick checks (`status`) never hash

        return xxhash.xxh3_128()
    import hashlib  # here: a run without signing never needs it

    return hashlib.new(algo)


def checksum_hasher() -> Any:
    """A fresh hash object of the manifest's checksum (``CHECKSUM_ALGO``), for bytes as they are
    written."""
    return _hasher(CHECKSUM_ALGO)


def hash_file(
    path: str | Path,
    algos: Sequence[str],
    progress: ProgressFn | None = None,
    chunk: int = READ_CHUNK,
    limit: int | None = None,
) -> list[str]:
    """Hex digests of one file, one per algorithm in ``algos``, from a single read in chunks of
    ``chunk`` bytes into one reused buffer (every algorithm is fed the same chunk; ``progress``
    hears of each: a caller that beats a heartbeat per chunk picks a chunk small enough for a slow
    file system). Only a regular file is read (``capped.NotRegular`` for a FIFO, which would block
    the open, or a link to ``/dev/zero``, which would never end), and never past ``limit`` bytes
    (the size a manifest lists): ``capped.TooLarge`` when there is more."""
    hashers = [_hasher(a) for a in algos]
    buf = bytearray(chunk)
    view = memoryview(buf)
    done = 0
    with open(path, "rb", buffering=0, opener=regular_only) as f:
        while n := f.readinto(buf):
            done += n
            if limit is not None and done > limit:
                raise TooLarge(path, f"longer than its listed {limit} bytes")
            for h in hashers:
                h.update(view[:n])
            if progress:
                progress(n)
    return [h.hexdigest() for h in hashers]


def checksum_file(path: str | Path, progress: ProgressFn | None = None, chunk: int = READ_CHUNK) -> str:
    """xxh3-128 of a file."""
    return hash_file(path, (CHECKSUM_ALGO,), progress, chunk)[0]


def _locked(report: ProgressFn, lock: threading.Lock) -> ProgressFn:
    """``report`` called under ``lock``: the hashing threads share it."""

    def tick(n: int) -> None:
        with lock:
            report(n)

    return tick


def hash_files(
    paths: Sequence[str | Path],
    algos: Sequence[str] = (CHECKSUM_ALGO,),
    progress: ProgressFn | None = None,
    threads: int = VERIFY_THREADS,
    chunk: int = READ_CHUNK,
    limits: Sequence[int] | None = None,
) -> list[list[str]]:
    """``hash_file`` of many files, in order, by up to ``threads`` threads (each read no further
    than its ``limits`` entry, when given). Raises the OSError of the first unreadable file (in
    ``paths`` order); ``progress`` is called under a lock."""
    results: list[list[str]] = [[] for _ in paths]
    errors: dict[int, BaseException] = {}  # an OSError, or what the progress raised (an interruption)
    lock = threading.Lock()
    todo = iter(range(len(paths)))

    tick = _locked(progress, lock) if progress else None

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = hash_file(paths[i], algos, tick, chunk, None if limits is None else limits[i])
            except OSError as e:
                e.filename = e.filename or os.fspath(paths[i])  # a failed read() names no file
                errors[i] = e
            except BaseException as e:  # raised again by the calling thread
                errors[i] = e
                return

    n = min(threads, len(paths))
    if n <= 1:  # in the calling thread: a read that never returns shows in its stack and syscall
        work()
    else:
        workers = [threading.Thread(target=work, daemon=True) for _ in range(n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    if errors:
        raise errors[min(errors)]
    return results


def checksum_files(
    paths: Sequence[str | Path], progress: ProgressFn | None = None, threads: int = VERIFY_THREADS
) -> list[str]:
    """xxh3-128 checksums of many files, in order (``hash_files``)."""
    return [h[0] for h in hash_files(paths, (CHECKSUM_ALGO,), progress, threads)]


def _raise(e: OSError) -> None:
    raise e


def list_files(ckpt_dir: str | Path) -> list[str]:
    """Every regular file under a checkpoint directory, as sorted relative POSIX paths. A directory
    that cannot be read raises its OSError: a listing that silently skipped it would report its
    files as missing, which is evidence of corruption it does not have."""
    root = os.fspath(ckpt_dir)
    out: list[str] = []
    # plain strings: `ckpt list` runs this per checkpoint
    for dirpath, _dirs, names in confined.walk(root, onerror=_raise):  # no deeper than a layout makes
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        out.extend(prefix + n for n in names)
    return sorted(out)


def file_sizes(ckpt_dir: str | Path) -> dict[str, int]:
    """Size of every file now in ``ckpt_dir``, the manifest and its signature aside."""
    root = Path(ckpt_dir)
    return {n: (root / n).stat().st_size for n in list_files(root) if n not in NOT_LISTED}


def build_manifest(
    ckpt_dir: str | Path,
    info: CheckpointInfo,
    *,
    known: Mapping[str, FileEntry] | None = None,
    writers: Mapping[int, Collection[str]] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> Manifest:
    """Describe every file now in ``ckpt_dir``; the manifest itself excluded.

    ``known`` holds entries already computed by the ranks that wrote those files (so the checksum
    work is spread over ranks); a known entry whose size no longer matches is recomputed.
    ``sizes``: ``file_sizes(ckpt_dir)`` when the caller has it already.
    """
    root = Path(ckpt_dir)
    known = known or {}
    sizes = file_sizes(root) if sizes is None else sizes
    todo = [n for n, size in sizes.items() if n not in known or known[n].size != size]
    sums = dict(zip(todo, checksum_files([root / n for n in todo]), strict=True))
    files = {n: FileEntry(sizes[n], sums[n]) if n in sums else known[n] for n in sizes}
    return Manifest(
        **asdict(info),  # copies parallelism and meta
        files=files,
        wall_time=time.time(),
        writers={r: tuple(sorted(names)) for r, names in sorted((writers or {}).items())},
    )
