"""Writes, moves and deletes that cannot leave the run directory, whatever was planted in it.

Whoever can write a run directory can put a symbolic link where the toolkit expects a directory
or a file: ``supervisor/`` -> ``~/.ssh``, ``quarantine/`` -> another user's run, ``events.jsonl``
-> ``~/.bashrc``. A plain ``open``, ``mkdir``, ``rename`` or ``rmtree`` follows it, and the toolkit
then appends, creates, moves or deletes outside the run directory with the user's rights. So every
write, move and delete of the run directory goes through here:

- a path is reached from the run directory's root one name at a time, each directory opened with
  ``O_NOFOLLOW | O_DIRECTORY`` relative to the one before (``openat``): a symbolic link on the
  way is refused, ``Escape``, one line naming it (a file there fails as it would: ENOTDIR); the
  root itself is the user's choice and may be a link (``/scratch/run`` -> ``/lustre/...``);
- the operation itself is made relative to the last directory's descriptor, on a name that
  ``O_NOFOLLOW`` (files) or a rename (which moves a link, never its target) cannot follow: there
  is no window between a check and the use;
- a file opened to write must be a regular file (a FIFO would block the writer);
- a tree is walked and removed through directory descriptors, never following a link, iteratively
  and at most ``MAX_DEPTH`` levels deep (1,200 nested directories made ``os.walk`` and
  ``os.fwalk`` raise RecursionError; no checkpoint of this layout is more than a few deep).

``Escape`` is an OSError (ELOOP: structural, never retried, supervisor/ioerrors.py), so every
caller's handling of a failed write applies to it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Protocol

# Deeper than any directory this layout makes (a checkpoint's files are at most a few levels
# down): a deeper tree is someone else's, walked no further.
MAX_DEPTH = 32
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Escape(OSError):
    """A path of the run directory leads out of it (a symbolic link), or a tree is deeper than any
    this layout makes: refused; nothing was written, moved or deleted through it. ``str(e)`` is
    one line naming the path. (A plain file where a directory must be is ENOTDIR, as raised.)"""

    def __init__(self, path: str | os.PathLike[str], why: str):
        super().__init__(
            errno.ELOOP,
            f"{why}; refused: nothing is written, moved or deleted through it (remove it, or move it "
            "aside, and retry)",
            os.fspath(path),
        )

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class Tick(Protocol):
    """What hears of each file removed (``heartbeat.Tracker`` has this shape)."""

    def __call__(self, n: int) -> None: ...

    def set_path(self, path: str) -> None: ...


def parts_under(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> list[str]:
    """The names that lead from ``root`` to ``path`` (both as given, compared lexically); Escape
    when ``path`` is not under ``root``."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == ".":
        return []
    parts = rel.split(os.sep)
    if parts[0] == os.pardir:
        raise Escape(path, f"not inside {os.fspath(root)}")
    return parts


def _is_link(fd: int, name: str) -> bool:
    """``name`` in the directory ``fd`` is a symbolic link."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_sub(fd: int, name: str, shown: str, create: bool) -> int:
    """The directory ``name`` in directory ``fd``, not through a link; made when ``create``."""
    for attempt in (0, 1):
        try:
            return os.open(name, _DIR, dir_fd=fd)
        except FileNotFoundError:
            if not create or attempt:
                raise
            with suppress(FileExistsError):
                os.mkdir(name, 0o777, dir_fd=fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, name):
                raise Escape(shown, "a symbolic link in the run directory") from None
            e.filename = e.filename if e.filename != name else shown  # a file where a directory goes: ENOTDIR
            raise
    raise AssertionError("unreachable")


@contextmanager
def directory(
    root: str | os.PathLike[str], path: str | os.PathLike[str], create: bool = False
) -> Iterator[int]:
    """A descriptor of the directory ``path`` under ``root``, reached from ``root`` without following
    any link (made on the way when ``create``, the root too: it is the user's); closed on exit."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        shown = Path(root)
        for name in parts_under(root, path):
            shown = shown / name
            sub = _open_sub(fd, name, os.fspath(shown), create)
            os.close(fd)
            fd = sub
        yield fd
    finally:
        os.close(fd)


@contextmanager
def parent(
    root: str | os.PathLike[str], path: str | os.PathLike[str], create: bool = False
) -> Iterator[tuple[int, str]]:
    """(descriptor of ``path``'s directory, reached as ``directory`` does; ``path``'s own name)."""
    p = Path(os.path.abspath(path))
    if not parts_under(root, p):
        raise Escape(path, "the run directory itself is not a file of it")
    with directory(root, p.parent, create) as fd:
        yield fd, p.name


def open_file(dir_fd: int, name: str, flags: int, shown: str | os.PathLike[str], mode: int = 0o666) -> int:
    """``name`` in ``dir_fd`` opened with ``flags``, never through a link (Escape), and only when
    it is a regular file (a FIFO would block a writer, a device swallow what it writes)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Escape(shown, "a symbolic link in the run directory") from None
        raise
    kind = os.fstat(fd).st_mode
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise Escape(shown, "not a regular file")
    return fd


def no_follow(path: str, flags: int) -> int:
    """An ``opener`` for ``open``/``io.FileIO`` that never follows a link at the file itself
    (ELOOP): for the files a writer makes in a directory of its own (a checkpoint being written)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def open_append(root: str | os.PathLike[str], path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """An ``O_APPEND`` descriptor of ``path`` (made, with its directories, when missing)."""
    with parent(root, path, create=True) as (fd, name):
        return open_file(fd, name, os.O_RDWR | os.O_APPEND | os.O_CREAT, path, mode)


def make_fifo(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> int:
    """A new FIFO at ``path`` (whatever had the name is replaced: a stale FIFO of an earlier
    launch, a link), open for reading and writing: its reader never sees an end of file, and a
    writer's open succeeds while it is open (``open_fifo``), fails with ENXIO once it is closed."""
    with parent(root, path, create=True) as (fd, name):
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
        os.mkfifo(name, 0o600, dir_fd=fd)
        out = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        if not stat.S_ISFIFO(os.fstat(out).st_mode):  # replaced between the two calls
            os.close(out)
            raise Escape(path, "not a FIFO")
        return out


def open_fifo(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> int:
    """``path``, a FIFO someone reads, open to write without blocking: ENXIO when nobody has it
    open to read, Escape when it is a link or no FIFO (a regular file planted there)."""
    with parent(root, path) as (fd, name):
        try:
            out = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise Escape(path, "a symbolic link in the run directory") from None
            raise
        if not stat.S_ISFIFO(os.fstat(out).st_mode):
            os.close(out)
            raise Escape(path, "not a FIFO")
        return out


def write_atomic(
    root: str | os.PathLike[str], path: str | os.PathLike[str], data: bytes, make_dirs: bool = True
) -> None:
    """``data`` to ``path`` so a reader sees the old content or the new, never a mix: a hidden
    temporary file made new beside it (``O_EXCL``), fsynced, renamed over it, the directory
    fsynced; ``path``'s directories are made when missing (unless not ``make_dirs``). A link at
    ``path`` is replaced, never followed."""
    with parent(root, path, create=make_dirs) as (dfd, name):
        tmp = f".{name}.{os.urandom(6).hex()}.tmp"  # not uuid: its import costs `status`
        try:
            fd = open_file(dfd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, Path(path).with_name(tmp))
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)


def write_new(root: str | os.PathLike[str], path: str | os.PathLike[str], data: bytes) -> None:
    """``data`` as the file ``path`` (created, or emptied first), fsynced: a file of a directory
    no reader sees yet (a checkpoint being committed). Through no link (Escape)."""
    with parent(root, path) as (dfd, name):
        fd = open_file(dfd, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, path)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def make_dirs(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """``mkdir -p path`` under ``root``, through no link (Escape naming the first one)."""
    with directory(root, path, create=True):
        pass


def rename(root: str | os.PathLike[str], src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Move ``src`` to ``dst``, both under ``root`` (their directories reached through no link;
    ``dst``'s made when missing). ``src`` itself may not be a link: what the toolkit moves is its
    own directory, and a link there is someone else's."""
    with parent(root, src) as (sfd, sname), parent(root, dst, create=True) as (dfd, dname):
        if stat.S_ISLNK(os.stat(sname, dir_fd=sfd, follow_symlinks=False).st_mode):
            raise Escape(src, "a symbolic link in the run directory")
        os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


def listdir(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> list[str]:
    """The names in the directory ``path`` under ``root``, reached through no link (Escape)."""
    with directory(root, path) as fd:
        return os.listdir(fd)


def unlink(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Remove the file (or link: never what it points to) ``path`` under ``root``."""
    with parent(root, path) as (fd, name):
        os.unlink(name, dir_fd=fd)


def fsync_dir(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Persist the entries of the directory ``path`` under ``root``."""
    with directory(root, path) as fd:
        os.fsync(fd)


def remove_tree(
    root: str | os.PathLike[str], top: str | os.PathLike[str], progress: Tick | None = None
) -> None:
    """Remove the directory ``top`` under ``root`` and everything in it, reporting each file
    removed to ``progress`` and naming ``top`` meanwhile. Through directory descriptors: a link
    inside is removed, never what it points to; a link at ``top`` itself, or on the way to it, is
    left (Escape). Nothing deeper than ``MAX_DEPTH`` is walked (it is left in place, as is
    whatever cannot be removed: the caller looks for leftovers)."""
    progress = progress or Unheard()
    progress.set_path(os.fspath(top))
    try:
        with parent(root, top) as (pfd, name):
            try:
                fd = os.open(name, _DIR, dir_fd=pfd)
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(pfd, name):
                    raise Escape(top, "a symbolic link in the run directory") from None
                raise
            _empty(fd, progress, 1)
            with suppress(OSError):
                os.rmdir(name, dir_fd=pfd)
    finally:
        progress.set_path("")


class Unheard:
    """The ``Tick`` of a removal nobody follows."""

    def __call__(self, n: int) -> None:
        pass

    def set_path(self, path: str) -> None:
        pass


def _empty(fd: int, progress: Tick, depth: int) -> None:
    """Remove what the directory ``fd`` holds (its descriptor is closed here), depth-first with
    one descriptor per level (at most ``MAX_DEPTH``), never following a link."""
    stack: list[tuple[int, Iterator[os.DirEntry[str]], str]] = []
    cur, entries = fd, iter(list(os.scandir(fd)))
    while True:
        entry = next(entries, None)
        if entry is None:
            os.close(cur)
            if not stack:
                return
            cur, entries, name = stack.pop()
            with suppress(OSError):
                os.rmdir(name, dir_fd=cur)
            continue
        is_dir = False
        with suppress(OSError):
            is_dir = entry.is_dir(follow_symlinks=False)
        if is_dir and depth + len(stack) < MAX_DEPTH:
            try:
                sub = os.open(entry.name, _DIR, dir_fd=cur)
            except OSError:
                continue
            stack.append((cur, entries, entry.name))
            cur, entries = sub, iter(list(os.scandir(sub)))
        elif not is_dir:
            with suppress(OSError):
                os.unlink(entry.name, dir_fd=cur)
            progress(1)


def walk(
    top: str | os.PathLike[str], onerror: Callable[[OSError], None] | None = None
) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top)`` (top-down, no link followed: a link is listed among the files, whatever it
    points to), iterative, and refusing a tree deeper than ``MAX_DEPTH``: Escape through
    ``onerror`` (raised when none is given), naming the directory too deep. A directory that
    cannot be listed goes to ``onerror`` (skipped when none is given)."""
    todo = [(os.fspath(top), 0)]
    while todo:
        folder, depth = todo.pop()
        if depth > MAX_DEPTH:
            e: OSError = Escape(
                folder, f"more than {MAX_DEPTH} directories deep: no directory this layout makes"
            )
            if onerror is None:
                raise e
            onerror(e)
            continue
        dirs: list[str] = []
        files: list[str] = []
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    (dirs if is_dir else files).append(entry.name)
        except OSError as err:
            if onerror is not None:
                onerror(err)
            continue
        yield folder, dirs, files
        todo.extend((os.path.join(folder, d), depth + 1) for d in reversed(dirs))
