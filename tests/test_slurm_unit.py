"""supervisor/slurm.py without a cluster: knobs, host lists, the launch command, the requeue
decision and its budget file, and ``slurm finish`` against a stand-in ``scontrol`` on PATH."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from commands import supervisor_cmd

from supervisor import slurm
from supervisor.exitcodes import Exit
from supervisor.slurm import JobEnv, Knobs, SlurmError

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2"}


def knob_env(root: Path, **extra: str) -> dict[str, str]:
    return {"RUN_DIR": str(root), "MAX_REQUEUES": "3", "TRAIN_ARGS": "-m train_ref.train", **extra}


# ---------------------------------------------------------------- host lists


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("localhost", ["localhost"]),
        ("gpu[07-10]", ["gpu07", "gpu08", "gpu09", "gpu10"]),
        ("a[1-2,5],login-b", ["a1", "a2", "a5", "login-b"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[8-11]-ib", ["n8-ib", "n9-ib", "n10-ib", "n11-ib"]),
    ],
)
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert slurm.expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["gpu[01-03", "gpu01]", "gpu[a-b]", "gpu[[1]]"])
def test_expand_hostlist_rejects_garbage(expr: str) -> None:
    with pytest.raises(SlurmError, match="cannot parse host list"):
        slurm.expand_hostlist(expr)


# ---------------------------------------------------------------- knobs and the launch command


def test_job_env_outside_a_job_says_how_to_submit() -> None:
    with pytest.raises(SlurmError, match=r"not inside a SLURM job.*sbatch sbatch/job.sh"):
        JobEnv.from_environ({})


def test_job_env_reads_restart_count() -> None:
    job = JobEnv.from_environ({**JOB, "SLURM_RESTART_COUNT": "2"})
    assert (job.job_id, job.num_nodes, job.restart_count) == ("4242", 2, 2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"RUN_DIR": ""}, "RUN_DIR is not set"),
        ({"MAX_REQUEUES": "many"}, "MAX_REQUEUES='many' is not a whole number"),
        ({"MAX_REQUEUES": "-1"}, "MAX_REQUEUES='-1'"),
        ({"NNODES": "2-4"}, "MIN:MAX"),
        ({"RDZV_PORT": "70000"}, "RDZV_PORT='70000'"),
        ({"TRAIN_ARGS": "-m 'unclosed"}, "TRAIN_ARGS=.*quote it"),
        ({"TRAIN_ARGS": ""}, "no trainer command"),
    ],
)
def test_bad_knobs_get_one_line_naming_the_variable(
    tmp_path: Path, extra: dict[str, str], message: str
) -> None:
    with pytest.raises(SlurmError, match=message) as e:
        Knobs.from_environ(knob_env(tmp_path, **extra))
    assert "\n" not in str(e.value)


def test_launch_command_keeps_every_value_one_argument(tmp_path: Path) -> None:
    root = tmp_path / "run dir; rm -rf $HOME"
    env = knob_env(
        root,
        PYTHON="/opt/my env/bin/python",
        CKPT_FLAG="--ckpt-root",
        NPROC_PER_NODE="4",
        TORCHRUN_OPTS="--log-dir '/tmp/a b'",
        WATCH_OPTS="--hang-timeout 30",
    )
    knobs = Knobs.from_environ(env, ["-m", "train_ref.train", "--corpus", "my corpus.txt"])
    job = JobEnv.from_environ(JOB)
    cmd = slurm.launch_command(knobs, slurm.rendezvous(job, knobs, "gpu07"))
    sep = cmd.index("--")
    assert cmd[:sep] == [
        "/opt/my env/bin/python", "-m", "supervisor", "watch", "--ckpt-root", str(root), "--requeue-exit",
        "--hang-timeout", "30",
    ]  # fmt: skip
    assert cmd[sep + 1 :] == [
        "/opt/my env/bin/python", "-m", "supervisor", "slurm", "torchrun", "--",
        "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:24242",
        "--rdzv-id=4242", "--log-dir", "/tmp/a b",
        "-m", "train_ref.train", "--corpus", "my corpus.txt", "--ckpt-root", str(root),
    ]  # fmt: skip


def test_elastic_nnodes_and_overrides(tmp_path: Path) -> None:
    env = knob_env(tmp_path, NNODES="1:4", RDZV_HOST="head-ib", RDZV_PORT="29400", CKPT_FLAG="")
    knobs = Knobs.from_environ(env)
    args = slurm.torchrun_args(knobs, slurm.rendezvous(JobEnv.from_environ(JOB), knobs, "gpu07"))
    assert "--nnodes=1:4" in args
    assert "--rdzv-endpoint=head-ib:29400" in args
    assert args[-2:] == ["-m", "train_ref.train"]  # CKPT_FLAG='' appends nothing


def test_default_rdzv_port_stays_below_the_ephemeral_range() -> None:
    ports = {slurm.default_rdzv_port(str(j)) for j in (1, 9999, 10000, 123456789)}
    assert ports == {20001, 29999, 20000, 26789}
    assert slurm.default_rdzv_port("77_3") == slurm.RDZV_PORT_BASE + 773  # array job ids


# ---------------------------------------------------------------- decision and budget


@pytest.mark.parametrize(
    ("code", "used", "requeue", "exit_code", "says"),
    [
        (Exit.OK, 0, False, 0, "run finished"),
        (Exit.REQUEUE_REQUESTED, 0, True, 0, "requeue 1 of 3"),
        (Exit.REQUEUE_REQUESTED, 2, True, 0, "requeue 3 of 3"),
        (Exit.REQUEUE_REQUESTED, 3, False, 13, "budget is used up (3 of 3)"),
        (Exit.STORAGE_UNAVAILABLE, 0, True, 0, "storage unavailable past the watchdog's retries"),
        (Exit.STORAGE_UNAVAILABLE, 1, True, 0, "requeue 2 of 3"),
        (Exit.STORAGE_UNAVAILABLE, 3, False, 14, "budget is used up (3 of 3)"),
        (Exit.CHILD_NONRETRYABLE, 0, False, 12, "non-retryable"),
        (Exit.BUDGET_EXHAUSTED, 0, False, 10, "restart budget"),
        (Exit.NO_PROGRESS, 0, False, 11, "without a newer checkpoint"),
        (1, 0, False, 1, "failed with exit code 1; not requeueing"),
        (143, 0, False, 143, "exit code 143"),
    ],
)
def test_decide(code: int, used: int, requeue: bool, exit_code: int, says: str) -> None:
    d = slurm.decide(code, used, 3)
    assert (d.requeue, d.exit_code) == (requeue, exit_code)
    assert says in d.reason


def test_requeue_state_round_trip_and_new_job(tmp_path: Path) -> None:
    job = JobEnv.from_environ(JOB)
    state, note = slurm.load_requeue_state(tmp_path, job, 5)
    assert (state.requeues, note) == (0, "")
    slurm.save_requeue_state(tmp_path, slurm.RequeueState(job_id="4242", requeues=2))
    again, note = slurm.load_requeue_state(tmp_path, job, 5)
    assert (again.requeues, again.max_requeues, note) == (2, 5, "")
    other = JobEnv.from_environ({**JOB, "SLURM_JOB_ID": "5000"})
    fresh, note = slurm.load_requeue_state(tmp_path, other, 5)
    assert fresh.requeues == 0
    assert "job 5000 starts a fresh budget" in note


def test_unreadable_requeue_state_is_kept_not_deleted(tmp_path: Path) -> None:
    path = slurm.requeue_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{garbage")
    state, note = slurm.load_requeue_state(tmp_path, JobEnv.from_environ(JOB), 5)
    assert state.requeues == 0
    assert "unreadable" in note
    assert path.with_name("slurm.json.bad").read_text() == "{garbage"


def test_requeue_state_that_cannot_be_read_falls_back_to_slurms_restart_count(tmp_path: Path) -> None:
    """Storage that fails (exit 14's case) is not garbage: nothing is moved aside, and SLURM's own
    restart count (an upper bound of this script's requeues) stands in for the count."""
    path = slurm.requeue_path(tmp_path)
    path.mkdir(parents=True)  # a read that fails for real (EISDIR), as EIO would
    job = JobEnv.from_environ({**JOB, "SLURM_RESTART_COUNT": "2"})
    state, note = slurm.load_requeue_state(tmp_path, job, 3)
    assert (state.requeues, state.max_requeues) == (2, 3) and "SLURM's restarts of this job (2)" in note
    assert path.is_dir() and not path.with_name("slurm.json.bad").exists()
    assert slurm.decide(Exit.STORAGE_UNAVAILABLE, state.requeues, 3).requeue
    assert not slurm.decide(Exit.STORAGE_UNAVAILABLE, 3, 3).requeue


def test_history_is_capped(tmp_path: Path) -> None:
    state = slurm.RequeueState(job_id="1")
    for i in range(slurm.KEEP_HISTORY + 5):
        state = state.with_event("start", n=i)
    assert len(state.history) == slurm.KEEP_HISTORY
    assert state.history[-1]["n"] == slurm.KEEP_HISTORY + 4


# ---------------------------------------------------------------- `slurm finish` with a stand-in scontrol

FAKE_SCONTROL = """#!/bin/sh
echo "$@" >> "$FAKE_SCONTROL_LOG"
exit "${FAKE_SCONTROL_EXIT:-0}"
"""


def run_finish(
    tmp_path: Path, code: int, *, with_scontrol: bool = True, **env: str
) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if with_scontrol:
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
        (bin_dir / "scontrol").chmod(0o755)
    full = {
        "PATH": f"{bin_dir}:/usr/bin:/bin" if with_scontrol else str(bin_dir),
        "FAKE_SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        **JOB,
        **knob_env(tmp_path / "run"),
        **env,
    }
    return subprocess.run(
        supervisor_cmd("slurm", "finish", "--exit-code", str(code)),
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )


def scontrol_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def requeues(tmp_path: Path) -> int:
    return json.loads(slurm.requeue_path(tmp_path / "run").read_text())["requeues"]


def test_finish_requeues_until_the_budget_is_used_up(tmp_path: Path) -> None:
    for _ in range(3):
        r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED)
        assert r.returncode == 0, r.stdout + r.stderr
    assert scontrol_calls(tmp_path) == ["requeue 4242"] * 3
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED)
    assert r.returncode == Exit.REQUEUE_REQUESTED
    assert "budget is used up (3 of 3)" in r.stdout
    assert len(scontrol_calls(tmp_path)) == 3
    assert requeues(tmp_path) == 3


@pytest.mark.parametrize("code", [Exit.OK, Exit.CHILD_NONRETRYABLE, 1])
def test_finish_never_requeues_a_finished_or_failed_run(tmp_path: Path, code: int) -> None:
    r = run_finish(tmp_path, code)
    assert r.returncode == code
    assert "job 4242 ends" in r.stdout
    assert scontrol_calls(tmp_path) == []


def test_finish_without_scontrol_says_so(tmp_path: Path) -> None:
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED, with_scontrol=False)
    assert r.returncode == Exit.REQUEUE_REQUESTED
    assert "scontrol not found on PATH" in r.stdout
    history = json.loads(slurm.requeue_path(tmp_path / "run").read_text())["history"]
    assert [h["event"] for h in history] == ["requeue", "requeue_failed"]


def test_finish_reports_a_failed_scontrol(tmp_path: Path) -> None:
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED, FAKE_SCONTROL_EXIT="1")
    assert r.returncode == Exit.REQUEUE_REQUESTED
    assert "`scontrol requeue 4242` failed (exit 1)" in r.stdout


def test_start_outside_a_job_is_a_usage_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        supervisor_cmd("slurm", "start"),
        env={**env, **knob_env(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == Exit.USAGE
    assert "not inside a SLURM job" in r.stdout


def test_start_without_scontrol_warns_and_expands_the_host_list_itself(tmp_path: Path) -> None:
    bin_dir = tmp_path / "empty-bin"
    bin_dir.mkdir()
    r = subprocess.run(
        supervisor_cmd("slurm", "start"),
        env={"PATH": str(bin_dir), **JOB, **knob_env(tmp_path / "run")},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 node(s): gpu07,gpu08" in r.stdout
    assert "built-in parser" in r.stdout
    assert "WARNING: scontrol not found on PATH: this job cannot requeue itself" in r.stdout
    assert "--rdzv-endpoint=gpu07:24242" in r.stdout
