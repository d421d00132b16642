"""No secrets in what the toolkit writes: URL user info and query-string credentials are redacted
in the event logs, ``state.json``, ``remote.json``, the job log, the trainer's log, the drill report
and the errors of the remote backends (supervisor/redact.py). No torch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd
from store_helpers import make_ckpt
from waiting import wait_for

from supervisor.drill.report import write_report
from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog, RunState, events_path, read_events, state_path, write_state
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import RunDir
from supervisor.redact import REDACTED, RedactFilter, redact, redact_log_handlers, redact_obj, redact_url
from supervisor.tiers.backends import DirBackend, RemoteConfigError, open_backend
from supervisor.tiers.remote import RemoteTier, RemoteUnavailable
from supervisor.tiers.uploader import Uploader, UploadPolicy

SECRETS = ("AKIAEXAMPLE", "s3cr3t", "hunter2", "SIGVALUE", "CREDVALUE", "TOKENVALUE", "SASVALUE")
# A remote URL and an endpoint as a careless user might pass them: every kind of credential.
URL = "s3://AKIAEXAMPLE:s3cr3t@bucket/run"
ENDPOINT = (
    "http://admin:hunter2@127.0.0.1:9/?X-Amz-Credential=CREDVALUE&X-Amz-Signature=SIGVALUE"
    "&X-Amz-Security-Token=TOKENVALUE&region=eu"
)


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


# ---------------------------------------------------------------- the pure function


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("s3://AKIA:secret@bucket/p", "s3://REDACTED@bucket/p"),
        ("https://token@github.com/o/r.git", "https://REDACTED@github.com/o/r.git"),
        ("https://u:p%40ss@h:9000", "https://REDACTED@h:9000"),
        ("https://u:p@ss@h/x", "https://REDACTED@h/x"),  # an unencoded @ in the password
        (
            "https://h/o?X-Amz-Algorithm=AWS4&X-Amz-Credential=AK%2F1&X-Amz-Signature=abc&x=1",
            "https://h/o?X-Amz-Algorithm=AWS4&X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED&x=1",
        ),
        ("https://acct.blob/c?sv=2022&se=2026&sp=r&sig=SAS", "https://acct.blob/c?sv=2022&se=2026&sp=r&sig=REDACTED"),
        ("https://h/?AWSAccessKeyId=AK&Expires=1&Signature=s", "https://h/?AWSAccessKeyId=REDACTED&Expires=1&Signature=REDACTED"),
        ("https://h/?token=t&password=p&api_key=k&key=v", "https://h/?token=REDACTED&password=REDACTED&api_key=REDACTED&key=REDACTED"),
        ("https://h/cb#access_token=t&state=s", "https://h/cb#access_token=REDACTED&state=s"),
        ("s3://bucket/run/step_00000010", "s3://bucket/run/step_00000010"),  # nothing secret: unchanged
        ("file:///scratch/run?x=1", "file:///scratch/run?x=1"),
    ],
)  # fmt: skip
def test_redact_url(url: str, want: str) -> None:
    assert redact_url(url) == want
    assert redact_url(want) == want  # idempotent


def test_redact_finds_urls_in_text_and_leaves_the_rest() -> None:
    text = f"remote {URL}: listing failed (EndpointConnectionError: Could not connect to '{ENDPOINT}')"
    out = redact(text)
    assert leaks(out) == [], out
    assert "s3://REDACTED@bucket/run: listing failed" in out and "region=eu" in out
    argv = str(["torchrun", "--remote", URL, "--remote-endpoint=" + ENDPOINT, "--lr=token=1"])
    out = redact(argv)
    assert leaks(out) == [] and "'--lr=token=1'" in out  # only URLs are touched
    assert redact("no url here: password=x") == "no url here: password=x"
    # botocore quotes an s3 URL's user info as part of an invalid bucket name, without its scheme
    assert (
        redact('Invalid bucket name "AKIA:s3cr3t@bucket": must')
        == 'Invalid bucket name "REDACTED@bucket": must'
    )
    assert redact("git@github.com:org/repo at 10:30 @home") == "git@github.com:org/repo at 10:30 @home"
    # SLURM's --signal=[B:]SIG@SECONDS is a number after the @, not a host; an address is one.
    assert redact("use --signal=B:USR1@120 (or B:URG@60)") == "use --signal=B:USR1@120 (or B:URG@60)"
    assert redact("u:pw@10.0.0.1:9000 and u:pw@7host") == "REDACTED@10.0.0.1:9000 and REDACTED@7host"


def test_redact_obj_walks_json() -> None:
    doc = {"url": URL, "n": 3, "cmd": ["a", URL], "t": (ENDPOINT,), "none": None}
    out = redact_obj(doc)
    assert leaks(json.dumps(out)) == [] and out["n"] == 3 and out["none"] is None
    assert isinstance(out["t"], tuple)


def test_log_filter_redacts_messages_arguments_and_tracebacks(tmp_path: Path) -> None:
    logger = logging.getLogger("test_security_redact")
    logger.propagate = False
    path = tmp_path / "log.txt"
    handler = logging.FileHandler(path)
    logger.addHandler(handler)
    redact_log_handlers(logger)
    redact_log_handlers(logger)  # twice: still one filter
    assert sum(isinstance(f, RedactFilter) for f in handler.filters) == 1
    try:
        logger.warning("remote %s down", URL)
        try:
            raise RuntimeError(f"cannot reach {ENDPOINT}")
        except RuntimeError:
            logger.exception("uploader cycle failed")
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = path.read_text()
    assert leaks(text) == [] and "s3://REDACTED@bucket/run down" in text and "RuntimeError" in text


# ---------------------------------------------------------------- the sinks


def test_event_log_state_and_echo_are_redacted(tmp_path: Path) -> None:
    echo = tmp_path / "echo.txt"
    with open(echo, "w") as f:
        EventLog(tmp_path, echo=f).emit(
            ev.RemoteDown(url=URL, error=f"{ENDPOINT} refused", lag_steps=None), f"{URL} unreachable"
        )
    write_state(tmp_path, RunState(command=("torchrun", "--remote", URL, "--remote-endpoint", ENDPOINT)))
    for path in (events_path(tmp_path), state_path(tmp_path), echo):
        text = path.read_text()
        assert leaks(text) == [], (path, text)
        assert REDACTED in text
    (rec,) = read_events(events_path(tmp_path))
    assert rec["url"] == "s3://REDACTED@bucket/run"


def test_backend_errors_and_remote_json_are_redacted(tmp_path: Path) -> None:
    """A backend whose errors quote its URL (as botocore's do): the RemoteUnavailable message, the
    uploader's remote.json (url and last_error) and its events carry no credential."""

    class Leaky(DirBackend):
        @property
        def url(self) -> str:
            return f"https://admin:hunter2@share.example/run?sig=SASVALUE#{self.root}"

        def names(self) -> list[str]:
            raise ConnectionError(f"Could not connect to {ENDPOINT}")

    root = tmp_path / "run"
    make_ckpt(root, 10)
    tier = RemoteTier(Leaky(tmp_path / "remote"))
    assert leaks(tier.url) == []
    with pytest.raises(RemoteUnavailable) as e:
        tier.scan()
    assert leaks(str(e.value)) == [] and "ConnectionError" in str(e.value)
    events = RunDir.of(root).supervisor / "events.remote.jsonl"
    up = Uploader(root, tier, UploadPolicy(attempts=1, local_keep=None)).start()  # its first cycle fails
    try:  # reported last, after remote.json
        wait_for(lambda: events.exists() and "remote_down" in events.read_text(), "the remote_down event")
    finally:
        up.close()
    status = RunDir.of(root).remote_status.read_text()
    assert json.loads(status)["state"] == "down"
    assert leaks(status) == [], status
    assert leaks(events.read_text()) == []


@pytest.mark.parametrize("url", ["gcs://AKIAEXAMPLE:s3cr3t@bucket/run", "nope://AKIAEXAMPLE:s3cr3t@host/run"])
def test_unusable_remote_url_errors_are_redacted(url: str) -> None:
    with pytest.raises(RemoteConfigError) as e:
        open_backend(url)
    assert leaks(str(e.value)) == [], str(e.value)
    assert "REDACTED@" in str(e.value)


def test_drill_report_is_redacted(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    write_report(
        report,
        settings=f"--remote {URL}",
        golden_digest="0" * 64,
        runs=[],
        verdicts=[],
        plot_line="![loss curves](p.png)",
    )
    assert leaks(report.read_text()) == [] and "s3://REDACTED@bucket/run" in report.read_text()


def test_job_log_line_is_redacted(tmp_path: Path) -> None:
    """`slurm start` prints the command every node runs: its --remote URL is redacted."""
    bin_dir = tmp_path / "empty-bin"
    bin_dir.mkdir()
    env = {
        "PATH": str(bin_dir),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "RUN_DIR": str(tmp_path / "run"),
        "MAX_REQUEUES": "3",
        "MAX_PREEMPT_REQUEUES": "100",
        "TRAIN_ARGS": f"-m train_ref.train --remote {URL} --remote-endpoint {ENDPOINT}",
    }
    r = subprocess.run(
        supervisor_cmd("slurm", "start"),
        env=env, capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "each node runs:" in r.stdout and "s3://REDACTED@bucket/run" in r.stdout
    assert leaks(r.stdout + r.stderr) == [], r.stdout


def test_watchdog_with_credentials_in_its_urls_writes_none_of_them(tmp_path: Path) -> None:
    """The real watchdog, its remote unreachable: its events, state and output (the job log) name
    the remote and the command line, redacted."""
    root = tmp_path / "run"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    cmd = supervisor_cmd("watch", "--ckpt-root", str(root), "--remote", URL)
    cmd += ["--remote-endpoint", ENDPOINT, "--remote-wait", "1", "--max-restarts", "0"]
    cmd += ["--", sys.executable, "-c", "pass", "--remote", URL, "--remote-endpoint", ENDPOINT]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == Exit.STORAGE_UNAVAILABLE, r.stderr[-2000:]  # unreachable remote: requeue
    log = read_events(events_path(root))
    assert [e for e in log if e["event"] == "remote_unavailable"], log
    written = {p: p.read_text() for p in RunDir.of(root).supervisor.iterdir()}
    for path, text in {**written, "stdout+stderr": r.stdout + r.stderr}.items():
        assert leaks(text) == [], (path, text[-2000:])
    assert "s3://REDACTED@bucket/run" in written[events_path(root)]
