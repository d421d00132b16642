"""supervisor/slurm.py without a cluster: knobs, host lists, the launch command, the requeue
decision and its budget file, and ``slurm finish`` against a stand-in ``scontrol`` on PATH."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from commands import supervisor_cmd
from slurm_helpers import JOB, knob_env, requeues, run_finish, scontrol_calls
from store_helpers import make_ckpt

from supervisor import slurm
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.eventnames import RequeueEvent
from supervisor.format.exitcodes import Exit
from supervisor.format.manifest import META_SAVE_S
from supervisor.format.notice import NoticeSignalError
from supervisor.slurm import JobEnv, Knobs, SaveTime, SlurmError

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
        ({"MAX_PREEMPT_REQUEUES": ""}, "MAX_PREEMPT_REQUEUES='': set it to a whole number"),
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
        "--notice-signal", "USR1", "--hang-timeout", "30",
    ]  # fmt: skip
    assert cmd[sep + 1 :] == [
        "/opt/my env/bin/python", "-m", "supervisor", "slurm", "torchrun", "--ignore-signal", "USR1", "--",
        "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07:24242",
        "--rdzv-id=4242", "--log-dir", "/tmp/a b",
        "-m", "train_ref.train", "--corpus", "my corpus.txt", "--ckpt-root", str(root),
    ]  # fmt: skip


def test_requeue_signal_follows_into_the_watchdog_and_torchrun(tmp_path: Path) -> None:
    knobs = Knobs.from_environ(knob_env(tmp_path, REQUEUE_SIGNAL="sigurg"))
    cmd = slurm.launch_command(knobs, slurm.rendezvous(JobEnv.from_environ(JOB), knobs, "gpu07"))
    assert cmd[cmd.index("--notice-signal") + 1] == "URG"
    assert cmd[cmd.index("--ignore-signal") + 1] == "URG"


@pytest.mark.parametrize("raw", ["HUP", "USR2", "TERM", "SIGINT", "QUIT", "KILL", "12"])
def test_requeue_signal_that_would_kill_torchrun_or_mean_a_stack_dump_is_refused(
    tmp_path: Path, raw: str
) -> None:
    with pytest.raises(NoticeSignalError, match=rf"REQUEUE_SIGNAL='{raw}': use USR1 or URG") as e:
        Knobs.from_environ(knob_env(tmp_path, REQUEUE_SIGNAL=raw))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("B:USR1@120", ""),
        ("b:SIGUSR1@30", ""),
        ("RB:10@300", ""),  # by number; R: (reservation) as well
        ("B:USR1", ""),  # @60 by default
        (None, "no --signal found (where): no notice comes before the time limit"),
        ("USR1@120", "has no B:, so SLURM signals the job steps but never this script"),
        ("R:USR1@120", "use --signal=B:USR1@120"),
        ("B:URG@90", "sends SIGURG but REQUEUE_SIGNAL=USR1"),
        ("B:USR1@soon", "cannot parse --signal='B:USR1@soon'"),
    ],
)
def test_notice_problem(spec: str | None, says: str) -> None:
    got = slurm.notice_problem(spec, "where", "USR1")
    assert (says in got) if says else got == "", got
    assert "\n" not in got


def test_script_signal_spec_reads_sbatch_lines_as_sbatch_does() -> None:
    script = "#!/bin/bash\n# a comment\n#SBATCH --time=1\n#SBATCH --signal=B:USR1@120\n\n#SBATCH --signal B:URG@60\n"
    assert slurm.script_signal_spec(script) == "B:URG@60"  # the last one wins
    assert (
        slurm.script_signal_spec(script + "srun x\n#SBATCH --signal=USR1\n") == "B:URG@60"
    )  # after a command: ignored
    assert slurm.script_signal_spec("#!/bin/bash\n##SBATCH --signal=B:USR1@1\necho\n") is None  # disabled
    assert slurm.script_signal_spec(
        Path(__file__).resolve().parents[1].joinpath("sbatch/job.sh").read_text()
    ) == ("B:USR1@120")


def test_array_task_requeues_its_own_id() -> None:
    """Task 0's job id is the array's id, and `scontrol requeue <array id>` requeues every task."""
    task = JobEnv.from_environ(
        {**JOB, "SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "0"}
    )
    assert (task.job_id, task.requeue_id) == ("77", "77_0")
    assert JobEnv.from_environ(JOB).requeue_id == "4242"


@pytest.mark.parametrize(
    "opts", ["--max-restarts=3", "--max-restarts 1", "--max_restarts=2", "--local-addr=x --max-restarts 5"]
)
def test_torchrun_restarts_are_refused(tmp_path: Path, opts: str) -> None:
    with pytest.raises(SlurmError, match=r"TORCHRUN_OPTS has --max-restarts .*fight the watchdog") as e:
        Knobs.from_environ(knob_env(tmp_path, TORCHRUN_OPTS=opts))
    assert "\n" not in str(e.value)


def test_torchrun_max_restarts_0_is_fine(tmp_path: Path) -> None:
    assert Knobs.from_environ(knob_env(tmp_path, TORCHRUN_OPTS="--max-restarts=0")).torchrun_opts == (
        "--max-restarts=0",
    )


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


LIMITS = slurm.Budgets(preempt=3, failure=2)


@pytest.mark.parametrize(
    ("code", "used", "requeue", "exit_code", "says"),
    [
        (Exit.OK, (0, 0), False, 0, "run finished"),
        (Exit.REQUEUE_REQUESTED, (0, 0), True, 0, "preemption requeue 1 of 3"),
        (Exit.REQUEUE_REQUESTED, (2, 2), True, 0, "preemption requeue 3 of 3"),  # failures do not count
        (Exit.REQUEUE_REQUESTED, (3, 0), False, 13, "preemption requeue budget is used up (3 of 3)"),
        (Exit.REQUEUE_REQUESTED, (3, 0), False, 13, "raise MAX_PREEMPT_REQUEUES"),
        (Exit.STORAGE_UNAVAILABLE, (0, 0), True, 0, "storage unavailable past the watchdog's retries"),
        (Exit.STORAGE_UNAVAILABLE, (3, 1), True, 0, "failure requeue 2 of 2"),  # preemptions do not count
        (Exit.STORAGE_UNAVAILABLE, (0, 2), False, 14, "failure requeue budget is used up (2 of 2)"),
        (Exit.STORAGE_UNAVAILABLE, (0, 2), False, 14, "raise MAX_REQUEUES"),
        (Exit.CHILD_NONRETRYABLE, (0, 0), False, 12, "non-retryable"),
        (Exit.BUDGET_EXHAUSTED, (0, 0), False, 10, "restart budget"),
        (Exit.NO_PROGRESS, (0, 0), False, 11, "without a newer checkpoint"),
        (1, (0, 0), False, 1, "failed with exit code 1; not requeueing"),
        (143, (0, 0), False, 143, "exit code 143"),
    ],
)
def test_decide_counts_preemptions_and_failures_separately(
    code: int, used: tuple[int, int], requeue: bool, exit_code: int, says: str
) -> None:
    d = slurm.decide(code, slurm.Budgets(*used), LIMITS)
    assert (d.requeue, d.exit_code) == (requeue, exit_code)
    assert says in d.reason


def test_requeue_state_round_trip_and_new_job(tmp_path: Path) -> None:
    job = JobEnv.from_environ(JOB)
    state, note = slurm.load_requeue_state(tmp_path, job, LIMITS)
    assert (state.used, note) == (slurm.Budgets(), "")
    slurm.save_requeue_state(
        tmp_path, state.counted(slurm.PREEMPT).counted(slurm.PREEMPT).counted(slurm.FAILURE)
    )
    again, note = slurm.load_requeue_state(tmp_path, job, slurm.Budgets(100, 10))
    assert (again.used, again.limits, note) == (slurm.Budgets(2, 1), slurm.Budgets(100, 10), "")
    assert slurm.budget_line(again) == "requeues used: preemption 2 of 100, failure 1 of 10"
    assert json.loads(slurm.requeue_path(tmp_path).read_text())["requeues"] == 3  # for version 1 readers
    other = JobEnv.from_environ({**JOB, "SLURM_JOB_ID": "5000"})
    fresh, note = slurm.load_requeue_state(tmp_path, other, LIMITS)
    assert fresh.used == slurm.Budgets()
    assert "job 5000 starts fresh budgets" in note


def test_version_1_file_is_read_and_split_by_its_history(tmp_path: Path) -> None:
    """A slurm.json written before the budgets were split: one count; its history tells which
    requeues followed a preemption (exit 13) and which a failure (exit 14)."""
    old = {
        "job_id": "4242",
        "requeues": 3,
        "max_requeues": 10,
        "restart_count": 3,
        "history": [
            {"event": "requeue", "job_id": "4242", "exit_code": 13},
            {"event": "requeue", "job_id": "4242", "exit_code": 14},
            {"event": "requeue", "job_id": "4242", "exit_code": 13},
            {"event": "requeue", "job_id": "1", "exit_code": 13},  # another job's
        ],
        "version": 1,
    }
    path = slurm.requeue_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(old))
    state, note = slurm.load_requeue_state(tmp_path, JobEnv.from_environ(JOB), LIMITS)
    assert (state.used, note, state.version) == (slurm.Budgets(preempt=2, failure=1), "", 2)
    assert len(state.history) == 4


def test_unreadable_requeue_state_is_kept_not_deleted(tmp_path: Path) -> None:
    path = slurm.requeue_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{garbage")
    state, note = slurm.load_requeue_state(tmp_path, JobEnv.from_environ(JOB), LIMITS)
    assert state.used == slurm.Budgets()
    assert "unreadable" in note
    assert path.with_name("slurm.json.bad").read_text() == "{garbage"


def test_requeue_state_that_cannot_be_read_falls_back_to_slurms_restart_count(tmp_path: Path) -> None:
    """Storage that fails (exit 14's case) is not garbage: nothing is moved aside, and SLURM's own
    restart count (an upper bound of this script's requeues of either kind) stands in for each count."""
    path = slurm.requeue_path(tmp_path)
    path.mkdir(parents=True)  # a read that fails for real (EISDIR), as EIO would
    job = JobEnv.from_environ({**JOB, "SLURM_RESTART_COUNT": "2"})
    state, note = slurm.load_requeue_state(tmp_path, job, LIMITS)
    assert (state.used, state.limits) == (slurm.Budgets(2, 2), LIMITS)
    assert "SLURM's restarts of this job (2)" in note
    assert path.is_dir() and not path.with_name("slurm.json.bad").exists()
    assert slurm.decide(Exit.REQUEUE_REQUESTED, state.used, LIMITS).requeue
    assert not slurm.decide(Exit.STORAGE_UNAVAILABLE, state.used, LIMITS).requeue


def test_history_is_capped(tmp_path: Path) -> None:
    state = slurm.RequeueState(job_id="1")
    for i in range(slurm.KEEP_HISTORY + 5):
        state = state.with_event(RequeueEvent.START, n=i)
    assert len(state.history) == slurm.KEEP_HISTORY
    assert state.history[-1]["n"] == slurm.KEEP_HISTORY + 4


# ---------------------------------------------------------------- `slurm finish` with a stand-in scontrol


def test_finish_requeues_until_each_budget_is_used_up(tmp_path: Path) -> None:
    """Preemptions (13) and failures (14) draw on their own budgets (3 and 2 here), whatever the
    order; each budget used up ends the job with its own code and the knob to raise."""
    for code in (13, 14, 13, 14, 13):
        r = run_finish(tmp_path, code)
        assert r.returncode == 0, r.stdout + r.stderr
    assert scontrol_calls(tmp_path) == ["requeue 4242"] * 5
    assert requeues(tmp_path) == (3, 2)
    r = run_finish(tmp_path, Exit.STORAGE_UNAVAILABLE)
    assert r.returncode == Exit.STORAGE_UNAVAILABLE
    assert "failure requeue budget is used up (2 of 2); resubmit, or raise MAX_REQUEUES" in r.stdout
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED)
    assert r.returncode == Exit.REQUEUE_REQUESTED
    assert "preemption requeue budget is used up (3 of 3)" in r.stdout
    assert len(scontrol_calls(tmp_path)) == 5
    assert requeues(tmp_path) == (3, 2)


@pytest.mark.parametrize("code", [Exit.OK, Exit.CHILD_NONRETRYABLE, 1])
def test_finish_never_requeues_a_finished_or_failed_run(tmp_path: Path, code: int) -> None:
    r = run_finish(tmp_path, code)
    assert r.returncode == code
    assert "job 4242 ends" in r.stdout
    assert scontrol_calls(tmp_path) == []


@pytest.mark.parametrize(
    ("info", "says"),
    [
        (None, ""),  # scontrol could not tell: requeue (the script's job)
        ({"JobState": "RUNNING", "Restarts": "0"}, ""),  # inside a preemption's grace: SLURM will not
        ({"JobState": "RUNNING", "Restarts": "2"}, ""),  # this run is the third start
        ({"JobState": "COMPLETING", "Restarts": "3"}, "SLURM is requeueing this job itself (Restarts=3"),
        ({"JobState": "COMPLETING", "Restarts": "2"}, "the job is ending (JobState=COMPLETING"),  # scancel
        ({"JobState": "TIMEOUT", "Restarts": "2"}, "JobState=TIMEOUT"),
    ],
)
def test_why_not_requeue(info: dict[str, str] | None, says: str) -> None:
    got = slurm.why_not_requeue(info, restart_count=2)
    assert (says in got) if says else got == "", got


def test_finish_leaves_the_requeue_to_slurm_when_slurm_already_did_it(tmp_path: Path) -> None:
    """PreemptMode=REQUEUE at the end of the GraceTime: SLURM has requeued the job (Restarts grew
    past this run's SLURM_RESTART_COUNT) and SIGTERMs the script; one requeue, not two."""
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED, FAKE_STATE="COMPLETING", FAKE_RESTARTS="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SLURM is requeueing this job itself" in r.stdout and "not requeueing it again" in r.stdout
    assert scontrol_calls(tmp_path) == []
    assert requeues(tmp_path) == (0, 0)
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED, FAKE_STATE="COMPLETING")  # a plain scancel
    assert r.returncode == Exit.REQUEUE_REQUESTED
    assert "the job is ending (JobState=COMPLETING" in r.stdout
    assert scontrol_calls(tmp_path) == []


def test_finish_in_an_array_task_requeues_the_task(tmp_path: Path) -> None:
    array = {"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "0"}
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED, **array)
    assert r.returncode == 0, r.stdout + r.stderr
    assert scontrol_calls(tmp_path) == ["requeue 77_0"]
    assert "scontrol requeue 77_0" in r.stdout


def test_torchrun_gives_its_workers_30_s_after_sigterm() -> None:
    """docs/slurm.md's SIGTERM window: torchrun's agent waits this long for its workers before
    SIGKILL (LocalElasticAgent._shutdown), fixed in torch; STOP_GRACE_S's default matches it."""
    import inspect

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert inspect.signature(LocalElasticAgent._shutdown).parameters["timeout"].default == 30
    assert slurm.TORCHRUN_TERM_WINDOW_S == 30
    job_sh = (Path(__file__).resolve().parents[1] / "sbatch" / "job.sh").read_text()
    assert ': "${STOP_GRACE_S:=30}"' in job_sh


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (None, ""),
        ({"PartitionName": "ci", "PreemptMode": "REQUEUE", "GraceTime": "60"}, ""),
        ({"PartitionName": "ci", "PreemptMode": "OFF", "GraceTime": "0"}, ""),  # never preempted
        (
            {"PartitionName": "gpu", "PreemptMode": "REQUEUE", "GraceTime": "0"},
            "partition gpu has PreemptMode",
        ),
        ({"PartitionName": "gpu", "PreemptMode": "CANCEL", "GraceTime": "20"}, "ask for GraceTime >= 30"),
    ],
)
def test_grace_problem(fields: dict[str, str] | None, says: str) -> None:
    got = slurm.grace_problem(fields, 45.0)  # torchrun's 30 s binds first
    assert (says in got) if says else got == "", got
    assert slurm.grace_problem({"PreemptMode": "REQUEUE", "GraceTime": "20"}, 15.0) == ""


def test_stop_grace_goes_to_the_watchdog(tmp_path: Path) -> None:
    knobs = Knobs.from_environ(knob_env(tmp_path, STOP_GRACE_S="45"))
    cmd = slurm.launch_command(knobs, slurm.rendezvous(JobEnv.from_environ(JOB), knobs, "gpu07"))
    assert cmd[cmd.index("--stop-grace") + 1] == "45"
    with pytest.raises(SlurmError, match="STOP_GRACE_S='0': set a number of seconds > 0"):
        Knobs.from_environ(knob_env(tmp_path, STOP_GRACE_S="0"))


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


def run_start(tmp_path: Path, script_text: str, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "slurm_script"
    script.write_text(script_text)
    return subprocess.run(
        supervisor_cmd("slurm", "start", "--job-script", str(script)),
        env={"PATH": "/nonexistent", **JOB, **knob_env(tmp_path / "run"), **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )


def test_start_warns_when_the_notice_can_never_arrive(tmp_path: Path) -> None:
    r = run_start(tmp_path, "#!/bin/bash\n#SBATCH --signal=USR1@120\nsrun true\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING: job 4242: --signal=USR1@120 (#SBATCH lines of" in r.stdout
    assert "has no B:" in r.stdout
    r = run_start(tmp_path, "#!/bin/bash\nsrun true\n")
    assert "WARNING: job 4242: no --signal found" in r.stdout
    # SBATCH_SIGNAL overrides the script's line, as in sbatch; URG goes to the steps by scancel
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text("#!/bin/sh\n")
    (bin_dir / "scancel").chmod(0o755)
    r = run_start(tmp_path, "#!/bin/bash\nsrun true\n", SBATCH_SIGNAL="B:URG@60", REQUEUE_SIGNAL="URG")
    assert r.returncode == Exit.USAGE
    assert "error: REQUEUE_SIGNAL=URG reaches the ranks through scancel" in r.stdout
    r = run_start(
        tmp_path,
        "#!/bin/bash\nsrun true\n",
        SBATCH_SIGNAL="B:URG@60",
        REQUEUE_SIGNAL="URG",
        PATH=str(bin_dir),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING: job 4242:" not in r.stdout, r.stdout
    r = run_start(tmp_path, "#!/bin/bash\n#SBATCH --signal=B:USR1@120\n", REQUEUE_SIGNAL="HUP")
    assert r.returncode == Exit.USAGE
    assert "error: REQUEUE_SIGNAL='HUP': use USR1 or URG" in r.stdout


@pytest.mark.parametrize(
    ("spec", "save_s", "says"),
    [
        ("B:USR1@120", 150.5, "gives 120 s notice before the time limit, but this run's last checkpoint"),
        ("B:USR1", 61.0, "gives 60 s notice"),  # sbatch's default lead
        ("B:USR1@120", 120.0, ""),
        ("B:USR1@120", None, ""),  # no checkpoint yet, or a trainer that does not record it
        (None, 500.0, ""),  # notice_problem's case
        ("B:USR1@x", 500.0, ""),  # notice_problem's case
    ],
)
def test_lead_problem(spec: str | None, save_s: float | None, says: str) -> None:
    save = SaveTime("step_00000500", save_s) if save_s is not None else None
    got = slurm.lead_problem(spec, "where", save)
    assert (says in got) if says else got == "", got
    if says:
        assert "(step_00000500) took" in got and "raise @" in got


def test_last_save_time_is_the_newest_readable_manifests(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert slurm.last_save_time(root) is None  # no run dir yet
    make_ckpt(root, 10, meta={META_SAVE_S: 3.5})
    make_ckpt(root, 20, meta={META_SAVE_S: 7.25})
    assert slurm.last_save_time(root) == SaveTime("step_00000020", 7.25)
    newest = make_ckpt(root, 30, meta={META_SAVE_S: 9.0})
    corrupt(newest.path, Corruption.GARBAGE_MANIFEST)
    assert slurm.last_save_time(root) == SaveTime("step_00000020", 7.25)
    make_ckpt(root, 40, meta={"launch": "x"})  # a trainer that does not record it
    assert slurm.last_save_time(root) is None


def test_start_warns_when_the_notice_comes_later_than_a_checkpoint_takes(tmp_path: Path) -> None:
    script = "#!/bin/bash\n#SBATCH --signal=B:USR1@120\nsrun true\n"
    make_ckpt(tmp_path / "run", 10, meta={META_SAVE_S: 30.0})
    r = run_start(tmp_path, script)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING: job 4242" not in r.stdout, r.stdout
    make_ckpt(tmp_path / "run", 20, meta={META_SAVE_S: 150.0})
    r = run_start(tmp_path, script)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING: job 4242: --signal=B:USR1@120 (#SBATCH lines of " in r.stdout, r.stdout
    assert "last checkpoint (step_00000020) took 150.0 s to save" in r.stdout
    r = run_start(tmp_path, script, SBATCH_SIGNAL="B:USR1@200")
    assert "WARNING: job 4242" not in r.stdout, r.stdout


def test_torchrun_refuses_a_signal_it_cannot_ignore_safely() -> None:
    r = subprocess.run(
        supervisor_cmd("slurm", "torchrun", "--ignore-signal", "TERM", "--", "--help"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert r.returncode == Exit.USAGE
    assert "error: --ignore-signal='TERM': use USR1 or URG" in r.stdout


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


def test_status_shows_both_budgets(tmp_path: Path) -> None:
    from supervisor.cli.status import render
    from supervisor.report import build_report

    assert build_report(tmp_path).slurm == ""  # a run not started by sbatch/job.sh
    state = slurm.RequeueState(job_id="4242", restart_count=3).with_limits(slurm.Budgets(100, 10))
    state = (
        state.counted(slurm.PREEMPT)
        .counted(slurm.PREEMPT)
        .counted(slurm.FAILURE)
        .with_event(RequeueEvent.START)
    )
    slurm.save_requeue_state(tmp_path, state)
    report = build_report(tmp_path)
    assert report.slurm == (
        "job 4242: requeues used: preemption 2 of 100, failure 1 of 10; SLURM restarts 3; last event start"
    )
    assert f"slurm {report.slurm}" in render(report)
    assert report.to_dict()["slurm"] == report.slurm
    slurm.requeue_path(tmp_path).write_text("[]")
    assert "slurm.json cannot be used: not a JSON object" in build_report(tmp_path).slurm


@pytest.mark.parametrize(
    ("nodes", "env", "says"),
    [
        ("2", {}, "0"),
        ("2", {"WATCH_OPTS": "--standby"}, "1"),
        ("1", {"WATCH_OPTS": "--standby"}, "0"),  # one node: its own standby, no roster
        ("2", {"WATCH_OPTS": "--standby-timeout-s 5"}, "0"),  # another flag that starts the same
        ("3", {"SPARE_NODES": "1"}, "1"),
    ],
)
def test_rostered_is_job_sh_roster(tmp_path: Path, nodes: str, env: dict[str, str], says: str) -> None:
    """job.sh's ROSTER (srun --no-kill, the coordinator's end) is this verb's one word."""
    r = subprocess.run(
        supervisor_cmd("slurm", "rostered"),
        env={**os.environ, **JOB, "SLURM_JOB_NUM_NODES": nodes, **knob_env(tmp_path / "run"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (0, says + "\n"), r.stdout + r.stderr
