"""Runs login-node commands (and watchdog readers) on hostile run directories for
tests/test_hostile.py, one forked child per job, and measures each child's peak RSS.

A server on stdin/stdout, one JSON object a line: a job ``{"argv": [...]}`` runs
``python -m supervisor ARGV`` in-process (``supervisor.cli.main.main``), ``{"code": "..."}`` execs
Python source; the answer is ``{"rc", "maxrss_kib", "out", "err", "seconds"}``. Imports are done
once here; each job forks from this single-threaded process (a fork is safe: no other thread holds
a lock), so a job costs a fork, not an interpreter start, and ``wait4`` gives that job's own
``ru_maxrss``. A child that does not end within the job's ``timeout`` is killed (rc -9): a test
that waits on it fails rather than hangs. A job of ``{"argv": []}`` that does nothing measures
the baseline a job's RSS is compared with (the fork inherits this process's resident pages).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback

import supervisor.cli.ckpt
import supervisor.cli.status
import supervisor.report
import supervisor.watch.rootcause  # noqa: F401  (imported before the fork: jobs use it)
from supervisor.cli.main import main as cli_main


def _child(job: dict, out_path: str, err_path: str) -> None:
    out = os.open(out_path, os.O_WRONLY | os.O_TRUNC)
    err = os.open(err_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    rc = 0
    try:
        if "code" in job:
            exec(compile(job["code"], "<job>", "exec"), {"__name__": "__job__"})
        elif job["argv"]:
            rc = cli_main(job["argv"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run(job: dict, scratch: str) -> dict:
    out_path, err_path = os.path.join(scratch, "out"), os.path.join(scratch, "err")
    for p in (out_path, err_path):
        open(p, "wb").close()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        if "cwd" in job:
            os.chdir(job["cwd"])
        _child(job, out_path, err_path)
    deadline = t0 + float(job.get("timeout", 60))
    while True:
        got, status, usage = os.wait4(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            got, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.002)
    rc = os.waitstatus_to_exitcode(status)
    with open(out_path, errors="backslashreplace") as f:
        out = f.read()
    with open(err_path, errors="backslashreplace") as f:
        err = f.read()
    return {"rc": rc, "maxrss_kib": usage.ru_maxrss, "out": out, "err": err, "seconds": time.monotonic() - t0}


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(run(json.loads(line), scratch)), flush=True)


if __name__ == "__main__":
    main()
