"""A hostile run directory, for tests/test_hostile*.py: a run directory to plant in (the plants
and the sentinel beside it are supervisor/drill/hostile.py's, shared with the drill), hostile JSON,
and a worker that runs the login-node commands on it and measures their peak RSS. No torch.

- ``make_run`` / ``outside``: a 2-rank run directory, and the sentinel folder beside it
  (``ROOT/../outside``), checked after every case: nothing may be written, moved or deleted there.
- ``hostile_json``: a valid record with one value replaced by a hostile JSON token (1e400, 2**70,
  a string for a number, "[[[..." nested past the recursion limit, ESC sequences, a lone
  surrogate) or its bytes cut or garbled; hypothesis draws them.
- ``Worker``: tests/hostile_worker.py, one process, a fork per job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from store_helpers import make_ckpt

from supervisor import store
from supervisor.drill.hostile import Outside, remove_deep
from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog, RunState, write_state
from supervisor.format.heartbeat import Heartbeat, Phase, write_heartbeat
from supervisor.format.layout import RunDir

REPO = Path(__file__).resolve().parent.parent
# A command's peak RSS may exceed the worker's baseline by at most this: what a 2 GiB sparse file
# read whole would take is 40x more, and reading a capped file (16 MiB at most) fits well within.
RSS_SLACK_KIB = 48 << 10
ESC = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"  # a window title, a screen clear, red


# ---------------------------------------------------------------- a run directory


RUN_PARENTS: list[Path] = []  # folders of the run directories made, removed by ``remove_runs``


def remove_runs() -> None:
    """Remove every run directory made (and the sentinel beside it) with ``remove_deep``: pytest's
    own cleanup recurses, and a planted nest makes it raise RecursionError at the session's end."""
    while RUN_PARENTS:
        parent = RUN_PARENTS.pop()
        if parent.exists():
            remove_deep(parent)


def outside(root: Path) -> Outside:
    """The sentinel beside the run directory ``root``: ``ROOT/../outside``."""
    return Outside(root.parent / "outside")


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
    EventLog(root, echo=None).emit(
        ev.Pick(checkpoint="step_00000020", verify="quick"), "resume from step_00000020"
    )
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
