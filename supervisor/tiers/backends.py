"""Where a remote tier keeps its bytes, named by a URL.

A plain path or ``file://`` URL is a shared filesystem: plain os calls, every object fsynced, a
checkpoint published by renaming its staging directory (the local commit protocol), mutations under
the tier root's lock. Any other URL goes through fsspec (``s3://bucket/prefix`` through s3fs, with
the endpoint from ``endpoint`` or ``AWS_ENDPOINT_URL``): object stores have no rename, so a
checkpoint is written in place and the manifest, written last by the caller, is the commit marker.

Keys are POSIX paths relative to the tier root, laid out like a run directory
(``step_00000050/...``, ``quarantine/step_00000050-<utc>/reason.txt``). fsspec and s3fs are
imported here only when such a URL is opened, so login-node commands stay fast.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from supervisor.format import confined
from supervisor.format.atomic import (
    atomic_write_bytes,
    fsync_dir,
    fsync_file,
    fsync_tree,
    hostname,
    pid_alive,
)
from supervisor.format.layout import MANIFEST, deleting_dirname, parse_committed, tmp_dirname
from supervisor.redact import redact
from supervisor.store import StoreError, list_deleting, list_tmp, root_lock, tmp_is_stale

ENV_ENDPOINT = "AWS_ENDPOINT_URL"
# One request each; retries and backoff belong to the caller (tenacity), so a dead endpoint is
# reported in seconds instead of botocore's and s3fs's nested retry loops.
S3_CONNECT_TIMEOUT_S = 5
S3_READ_TIMEOUT_S = 60
S3_PARALLEL = 4


class Backend(Protocol):
    """The few primitives the tier protocol (remote.py) needs from a storage system."""

    @property
    def url(self) -> str: ...

    @property
    def parallel(self) -> int:
        """Files transferred at a time."""
        ...

    def names(self) -> list[str]:
        """Names directly under the tier root."""
        ...

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` as {path relative to prefix: size}; {} when none."""
        ...

    def read(self, key: str) -> bytes: ...

    def write(self, key: str, data: bytes) -> None:
        """Store a small object so a reader sees all of it or nothing."""
        ...

    def put_file(self, src: Path, key: str) -> None: ...

    def get_file(self, key: str, dest: Path) -> None: ...

    def staging(self, name: str) -> str:
        """Prefix an upload of checkpoint ``name`` is written under before ``publish``."""
        ...

    def publish(self, staging: str, name: str) -> None: ...

    def move(self, src: str, dst: str) -> None:
        """Move a whole prefix; the source stops being a checkpoint before anything is lost."""
        ...

    def remove(self, prefix: str) -> None:
        """Delete a prefix, its manifest first so a half-removed one is never complete."""
        ...

    def stale_staging(self, stale_after_s: float) -> list[str]:
        """Staging prefixes left by dead uploaders (silent for ``stale_after_s``, as the store says)."""
        ...


class RemoteConfigError(StoreError):
    """The remote URL cannot be used (unknown scheme, missing package): one line, with the fix."""


# ---------------------------------------------------------------- shared filesystem


@dataclass(frozen=True)
class DirBackend:
    """A directory on a shared filesystem, itself a run directory in the store's format."""

    root: Path
    parallel: int = 1  # one disk: concurrent streams only seek

    @property
    def url(self) -> str:
        return str(self.root)

    def _p(self, key: str) -> Path:
        return self.root / key

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def sizes(self, prefix: str) -> dict[str, int]:
        base = self._p(prefix)
        out = {}
        for dirpath, _dirs, files in confined.walk(base):  # iterative, and no deeper than a layout makes
            for n in files:
                p = Path(dirpath) / n
                out[p.relative_to(base).as_posix()] = p.stat().st_size
        return out

    def read(self, key: str) -> bytes:
        return self._p(key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        p = self._p(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(p, data)

    def put_file(self, src: Path, key: str) -> None:
        p = self._p(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, p)  # the kernel's copy path (copy_file_range / sendfile)
        fsync_file(p)

    def get_file(self, key: str, dest: Path) -> None:
        shutil.copyfile(self._p(key), dest)  # made durable by the local commit

    def staging(self, name: str) -> str:
        step = parse_committed(name)
        if step is None:
            raise ValueError(f"{name} is not a checkpoint name")
        self.root.mkdir(parents=True, exist_ok=True)
        return tmp_dirname(step, os.getpid(), hostname())

    def publish(self, staging: str, name: str) -> None:
        src, dst = self._p(staging), self._p(name)
        fsync_tree(src)
        with root_lock(self.root):
            if dst.exists():
                raise FileExistsError(f"{dst} appeared during the upload")
            os.rename(src, dst)
            fsync_dir(self.root)

    def move(self, src: str, dst: str) -> None:
        s, d = self._p(src), self._p(dst)
        d.parent.mkdir(parents=True, exist_ok=True)
        with root_lock(self.root):
            os.rename(s, d)
            fsync_dir(s.parent)
            fsync_dir(d.parent)

    def remove(self, prefix: str) -> None:
        """As the store prunes: renamed aside under the lock, so no reader sees it half deleted."""
        p = self._p(prefix)
        step = parse_committed(p.name)
        with root_lock(self.root):
            if not p.exists():
                return
            if step is not None and p.parent == self.root:
                aside = self.root / deleting_dirname(step, os.getpid(), hostname())
                os.rename(p, aside)
                fsync_dir(self.root)
                p = aside
        shutil.rmtree(p, ignore_errors=True)
        fsync_dir(self.root)

    def stale_staging(self, stale_after_s: float) -> list[str]:
        me = hostname()
        marked = list_tmp(self.root) + list_deleting(self.root)
        return sorted(t.path.name for t in marked if tmp_is_stale(t, me, pid_alive, stale_after_s))


# ---------------------------------------------------------------- object stores (fsspec)


@dataclass(frozen=True)
class FsspecBackend:
    """Any fsspec filesystem; no rename is assumed, so checkpoints are written in place."""

    url: str
    fs: Any
    root: str
    parallel: int = S3_PARALLEL  # object stores serve requests side by side

    def _p(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def sizes(self, prefix: str) -> dict[str, int]:
        base = self._p(prefix).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            rel = path[len(base) + 1 :] if path.startswith(base + "/") else None
            if rel and info.get("type") != "directory":
                out[rel] = int(info["size"])
        return out

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self._p(key))

    def write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(key), data)

    def put_file(self, src: Path, key: str) -> None:
        self.fs.put_file(str(src), self._p(key))

    def get_file(self, key: str, dest: Path) -> None:
        self.fs.get_file(self._p(key), str(dest))

    def staging(self, name: str) -> str:
        return name

    def publish(self, staging: str, name: str) -> None:
        if staging != name:
            raise ValueError("object stores write checkpoints in place")

    def move(self, src: str, dst: str) -> None:
        rels = self.sizes(src)
        for rel in sorted(rels, key=lambda r: r == MANIFEST):  # the manifest copied last
            self.fs.copy(self._p(f"{src}/{rel}"), self._p(f"{dst}/{rel}"))
        self.remove(src)

    def remove(self, prefix: str) -> None:
        rels = self.sizes(prefix)
        if MANIFEST in rels:
            self.fs.rm_file(self._p(f"{prefix}/{MANIFEST}"))
        rest = [self._p(f"{prefix}/{r}") for r in sorted(rels) if r != MANIFEST]
        if rest:
            self.fs.rm(rest)

    def stale_staging(self, stale_after_s: float) -> list[str]:
        return []


# ---------------------------------------------------------------- opening a URL


def is_dir_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def open_backend(url: str, endpoint: str | None = None) -> Backend:
    """The backend for ``url``; a one-line RemoteConfigError when it cannot be used (the URL in it
    redacted: it may carry credentials)."""
    if not url:
        raise RemoteConfigError("--remote is empty: give a directory, file://PATH or s3://BUCKET/PREFIX")
    if is_dir_url(url):
        path = url[len("file://") :] if url.startswith("file://") else url
        return DirBackend(Path(path).absolute())
    protocol, rest = url.split("://", 1)
    if not rest.strip("/"):
        raise RemoteConfigError(f"{redact(url)}: name a bucket (and a prefix), e.g. {protocol}://bucket/run1")
    try:
        import fsspec
    except ImportError:
        raise RemoteConfigError(f"{redact(url)}: remote URLs need fsspec (pip install fsspec)") from None
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    if protocol in ("s3", "s3a"):
        options.update(_s3_options(endpoint or os.environ.get(ENV_ENDPOINT)))
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        extra = "s3" if protocol in ("s3", "s3a") else protocol
        raise RemoteConfigError(
            f"{redact(url)}: the {protocol}:// scheme needs a package ({e}); "
            f"pip install 'resumable-training[{extra}]'"
        ) from None
    except ValueError as e:
        raise RemoteConfigError(redact(f"{url}: {e}")) from None
    if protocol in ("s3", "s3a"):
        fs.retries = 1
    return FsspecBackend(url, fs, root.rstrip("/"))


def _s3_options(endpoint: str | None) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "config_kwargs": {
            # One attempt in total ("max_attempts" would mean one *retry*): botocore's retry
            # jitter draws from the process-wide `random`, which the uploader thread shares with the
            # training loop; a draw there made a run with an outage end with other parameters.
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "connect_timeout": S3_CONNECT_TIMEOUT_S,
            "read_timeout": S3_READ_TIMEOUT_S,
        },
    }
    if endpoint:
        opts["endpoint_url"] = endpoint
    return opts
