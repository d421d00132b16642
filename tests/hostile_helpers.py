"""A hostile run directory, for tests/test_hostile*.py: what an attacker with write access to it
(or bad luck) plants there, a sentinel folder beside it that nothing may touch, and a worker that
runs the login-node commands on it and measures their peak RSS. No torch.

- ``Outside``: the sentinel, ``ROOT/../outside``: a ``.bashrc``, a signing key file, another user's
  run with a checkpoint; ``changes()`` says what differs from when it was made (checked after
  every case: nothing may be written, moved or deleted there).
- ``plant_*``: the directory shapes (symlinks to the sentinel and to ``/dev/zero``, FIFOs, sparse
  files of GiBs, 1,200 nested directories).
- ``hostile_json``: a valid record with one value replaced by a hostile JSON token (1e400, 2**70,
  a string for a number, "[[[..." nested past the recursion limit, ESC sequences, a lone
  surrogate) or its bytes cut or garbled; hypothesis draws them.
- ``Worker``: tests/hostile_worker.py, one process, a fork per job.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from store_helpers import make_ckpt

from supervisor import store
from supervisor.format.events import EventLog, RunState, write_state
from supervisor.format.heartbeat import Heartbeat, Phase, write_heartbeat
from supervisor.format.layout import RunDir

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
NEST = 1200  # directories deep: past Python's recursion limit for os.walk / os.fwalk
# A command's peak RSS may exceed the worker's baseline by at most this: what a 2 GiB sparse file
# read whole would take is 40x more, and reading a capped file (16 MiB at most) fits well within.
RSS_SLACK_KIB = 48 << 10
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"  # a window title, a screen clear, red


# ---------------------------------------------------------------- the sentinel


class Outside:
    """A folder beside the run directory; ``changes()`` lists every entry added, removed or
    changed in it (type, mode, size, content, mtime), without following links."""

    def __init__(self, root: Path):
        self.path = root.parent / "outside"
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / ".bashrc").write_text("export PATH=$PATH\n")
        key = self.path / "run.key"
        key.write_bytes(b"k" * 48)
        key.chmod(0o600)
        victim = self.path / "victim"
        for step in (10, 20):
            d = victim / f"step_{step:08d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "__0_0.distcp").write_bytes(os.urandom(64))
        (victim / "quarantine").mkdir(exist_ok=True)
        q = victim / "quarantine" / "step_00000005-20260101T000000Z"
        q.mkdir(exist_ok=True)
        (q / "reason.txt").write_text("the victim's own\n")
        self.before = self.snapshot()

    @property
    def bashrc(self) -> Path:
        return self.path / ".bashrc"

    @property
    def key(self) -> Path:
        return self.path / "run.key"

    @property
    def victim(self) -> Path:
        return self.path / "victim"

    def snapshot(self) -> dict[str, tuple[Any, ...]]:
        out: dict[str, tuple[Any, ...]] = {}
        for dirpath, dirs, files in os.walk(self.path):
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                s = os.lstat(p)
                digest = ""
                if stat.S_ISREG(s.st_mode):
                    with open(p, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                out[os.path.relpath(p, self.path)] = (
                    stat.S_IFMT(s.st_mode),
                    s.st_mode,
                    s.st_size,
                    digest,
                    s.st_mtime_ns,
                )
        return out

    def changes(self) -> list[str]:
        now = self.snapshot()
        return sorted(
            f"{name}: {'added' if name not in self.before else 'removed' if name not in now else 'changed'}"
            for name in set(self.before) | set(now)
            if self.before.get(name) != now.get(name)
        )


# ---------------------------------------------------------------- a run directory


RUN_PARENTS: list[Path] = []  # folders of the run directories made, removed by ``remove_runs``


def remove_runs() -> None:
    """Remove every run directory made (and the sentinel beside it) with ``remove_tree_deep``."""
    while RUN_PARENTS:
        parent = RUN_PARENTS.pop()
        if parent.exists():
            remove_tree_deep(parent)


def make_run(root: Path) -> Path:
    """A run directory as a 2-rank run leaves it, torch-free: checkpoints 10 and 20 (DCP-like
    files, committed through the store), the watchdog's state and event log, heartbeats, the
    retention policy, metrics, ``latest``. Its parent is removed after the test (``RUN_PARENTS``)."""
    RUN_PARENTS.append(root.parent)
    root.mkdir(parents=True, exist_ok=True)
    for step in (10, 20):
        make_ckpt(root, step, parallelism={"mode": "ddp", "world_size": 2, "global_batch": 8})
    store.record_policy(root, store.RetentionPolicy(keep=2))
    write_state(root, RunState(node=0, host="vm", watchdog_pid=os.getpid(), status="running", command=("x",)))
    EventLog(root, echo=None).emit("pick", "resume from step_00000020")  # type: ignore[arg-type]
    for rank in (0, 1):
        write_heartbeat(
            root,
            Heartbeat(
                rank=rank,
                local_rank=rank,
                host="vm",
                pid=os.getpid(),
                step=20,
                phase=Phase.TRAIN,
                wall_time=0.0,
            ),
        )
    RunDir.of(root).metrics.write_text('{"step": 20, "loss": 1.0, "lr": 0.1}\n')
    return root


# ---------------------------------------------------------------- planting


def replace_with(path: Path) -> None:
    """Remove whatever is at ``path`` (file, link, tree), so something else can be planted."""
    if path.is_symlink() or path.is_file() or path.is_fifo():
        path.unlink()
    elif path.is_dir():
        import shutil

        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)


def plant_link(path: Path, target: Path | str) -> None:
    replace_with(path)
    path.symlink_to(target)


def plant_fifo(path: Path) -> None:
    replace_with(path)
    os.mkfifo(path)


def plant_sparse(path: Path, size: int = 2 * GIB) -> None:
    """A file of ``size`` bytes that takes no disk (``truncate -s``): read whole, all of it is memory."""
    replace_with(path)
    with open(path, "wb") as f:
        f.truncate(size)


def plant_nest(path: Path, depth: int = NEST) -> None:
    """``depth`` directories, one inside the other, under ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
            f.write(b"deep")
    finally:
        os.close(fd)


def remove_tree_deep(top: Path) -> None:
    """``shutil.rmtree`` without recursion (pytest's own cleanup recurses, and a 1,200-deep nest
    makes it raise RecursionError at the end of the session); links removed, never followed."""
    stack: list[tuple[str, bool]] = [(str(top), False)]
    while stack:
        path, emptied = stack.pop()
        if emptied:
            os.rmdir(path)
            continue
        stack.append((path, True))
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, False))
                else:
                    os.unlink(e.path)


def rewrite_manifest(ckpt: Path, **fields: Any) -> None:
    """Edit fields of a manifest as an attacker without the key would (the store re-reads it)."""
    m = json.loads((ckpt / "manifest.json").read_text())
    m.update(fields)
    (ckpt / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------- hostile JSON

# JSON text that parses into what no record of the run holds, or does not parse at all.
HOSTILE_TOKENS = (
    "1e400",  # infinity: int() of it overflows
    "-1e400",
    "NaN",
    str(2**70),  # past every pid, every C int
    "-1",
    "0",
    '"eight"',  # a string where a number goes
    '""',
    "null",
    "true",
    "[]",
    "{}",
    "[" * 5000 + "]" * 5000,  # nested past the recursion limit
    '{"a":' * 3000 + "1" + "}" * 3000,
    '"' + "9" * 5000 + '"',
    "9" * 5000,  # more digits than int() takes
    json.dumps(ESC),
    '"\\ud800"',  # a lone surrogate: no terminal encodes it
    json.dumps("x" * 100_000),
    json.dumps("../../../../etc/passwd"),
)
_MARK = "@@hostile@@"


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON value (the root too)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _with(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict):
        return {**value, head: _with(value[head], tuple(rest), new)}
    out = list(value)
    out[head] = _with(out[head], tuple(rest), new)
    return out


@st.composite
def hostile_json(draw: st.DrawFn, valid: Any) -> bytes:
    """``valid`` (a JSON value) with one value replaced by a hostile token, or a key added with
    one, or its text cut short, or garbage bytes in it, or not JSON at all."""
    how = draw(st.sampled_from(("replace", "add", "cut", "garble", "other")))
    text = json.dumps(valid, indent=1).encode()
    if how == "cut":
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    if how == "garble":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.binary(min_size=1, max_size=16)) + text[at:]
    if how == "other":
        return draw(st.sampled_from([t.encode() for t in HOSTILE_TOKENS] + [b"", b"\xff\xfe", b"\x00" * 64]))
    token = draw(st.sampled_from(HOSTILE_TOKENS))
    if how == "add" and isinstance(valid, dict):
        doc = {**valid, draw(st.sampled_from(("extra", "\x1b[31m", "host"))): _MARK}
    else:
        path = draw(st.sampled_from(_paths(valid)))
        doc = _with(valid, path, _MARK)
    return json.dumps(doc, indent=1).replace(json.dumps(_MARK), token).encode()


# ---------------------------------------------------------------- the worker


@dataclass(frozen=True)
class Result:
    rc: int
    maxrss_kib: int
    out: str
    err: str
    seconds: float

    @property
    def text(self) -> str:
        return self.out + self.err


class Worker:
    """tests/hostile_worker.py, started once; ``run`` a job, ``baseline_kib`` its RSS doing nothing."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "hostile_worker.py")],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's code, whatever is installed
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.baseline_kib = max(self.run(argv=[]).maxrss_kib for _ in range(3))

    def run(self, *, argv: list[str] | None = None, code: str | None = None, timeout: float = 120) -> Result:
        job: dict[str, Any] = {
            "timeout": timeout,
            **({"code": code} if code is not None else {"argv": argv or []}),
        }
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return Result(**json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def assert_calm(r: Result, what: str, worker: Worker, codes: tuple[int, ...] = (0, 1, 2, 3)) -> None:
    """``r`` ended with one of ``codes``, without a traceback or a killed child, within the RSS
    slack over the worker's baseline, and wrote nothing a terminal would act on."""
    assert r.rc in codes, f"{what}: exit {r.rc}\n{r.text[-3000:]}"
    assert "Traceback" not in r.text, f"{what}: a traceback\n{r.text[-3000:]}"
    assert r.maxrss_kib - worker.baseline_kib <= RSS_SLACK_KIB, (
        f"{what}: peak RSS {r.maxrss_kib} KiB, {r.maxrss_kib - worker.baseline_kib} KiB over the baseline "
        f"{worker.baseline_kib} KiB"
    )
    assert "\x1b" not in r.text and "\x07" not in r.text, (
        f"{what}: a raw escape in the output\n{r.text[-2000:]!r}"
    )
