"""``watch --standby`` over a user's loop (examples/plain_loop.py: ``Resumable``, two DataLoader
workers per rank, no call of its own to the standby gate): its import of ``supervisor.resumable``
holds the standby launch until the watchdog releases it, the relaunch after a kill -9 is that
standby, and the run ends bit-identical to the script's own uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from commands import REPO
from trainer_helpers import digest
from waiting import PATIENCE_S, wait_for, wait_held, watchdog_events
from watch_helpers import events, finish, leftovers, of, watch_argv

from supervisor.format.exitcodes import Exit
from supervisor.format.hooks import ENV_BOUNDARY_HOOK
from supervisor.format.layout import RunDir
from supervisor.format.metrics import read_metrics
from train_ref import hold

pytestmark = pytest.mark.slow

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, SAVE_EVERY, HOLD_AT = 30, 5, 12
# The held ranks beat no heartbeat (the hook has none to beat) for as long as the standby takes to
# get ready: a hang timeout as long as the test's patience, so no verdict cuts the hold short.
WATCH = ["--hang-timeout", f"{PATIENCE_S:g}", "--poll-interval", "0.2", "--backoff-initial", "0.5"]
WATCH += ["--backoff-jitter", "0"]


def plain_loop(root: Path) -> list[str]:
    return [
        TORCHRUN, "--standalone", "--nproc-per-node=2", "examples/plain_loop.py",
        "--ckpt-root", str(root), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--num-workers", "2",
    ]  # fmt: skip


def test_a_users_loop_relaunches_from_the_standby_its_import_of_the_api_gated(tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        plain_loop(golden), cwd=REPO, env=env, capture_output=True, text=True, timeout=PATIENCE_S
    )
    assert done.returncode == 0, done.stderr[-3000:]

    root, gate = tmp_path / "run", tmp_path / "hold"
    hold.hold_at(gate, HOLD_AT)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
            hold.ENV_HOLD_FILE: str(gate),
            ENV_BOUNDARY_HOOK: "hold_hook:boundary_hook",
        }
    )
    argv = watch_argv(root, [*WATCH, "--standby"], plain_loop(root))
    p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    victim = wait_held(gate, 2, HOLD_AT, proc=p)[0]["pid"]
    spare = wait_for(lambda: watchdog_events(root, "standby"), "a standby launch", proc=p)[0]
    ready = RunDir.of(root).launch_dir(spare["launch_id"])

    def trained() -> list[int]:  # the standby's steps: without the gate it would train at once
        return [m.step for m in read_metrics(root / "metrics.jsonl") if m.launch == spare["launch_id"]]

    wait_for(
        lambda: len(list(ready.glob("ready_*"))) == 2 or trained(), "the standby's 2 ranks ready", proc=p
    )
    assert not trained()
    os.kill(victim, signal.SIGKILL)
    hold.release(gate)
    rc, out = finish(p)
    assert rc == Exit.OK, out[-3000:]
    second = of(events(root), "launch")[1]
    assert (second["launch_id"], second["pid"]) == (spare["launch_id"], spare["pid"])
    assert digest(root) == digest(golden)
    assert not leftovers(root)
