"""The trainer's side of the remote tier: one background upload at a time, never a stall past policy.

Rank 0 calls ``Uploader.submit(ref)`` after each local commit. One worker thread uploads; each
cycle it lists both tiers and uploads what ``plan_uploads`` says (the newest local checkpoint the
remote lacks, then local milestones it lacks), retrying errors with tenacity backoff. The same
cycle is the catch-up: after a crash, a restart or an outage, the newest local checkpoint not yet
remote is uploaded first.

Busy policy (a save is ready while the previous upload still runs):
  skip  ``submit`` returns at once; the worker uploads the newest checkpoint when the current upload
        ends, and every checkpoint superseded in between is logged as skipped (``upload_skipped``).
  wait  ``submit`` blocks until the current upload ends, at most ``wait_timeout_s``; then as skip.

A remote that stays down after the retries is reported (``remote_down`` event, state "down" in
ROOT/supervisor/remote.json with the lag and the last error) and retried every ``down_retry_s``
and on each submit; training goes on with local checkpoints. Retention runs in the worker between
uploads, so a checkpoint being uploaded is never pruned under it: the remote keeps ``remote_keep``
plus every ``milestone_every``-th step, the local run directory only its newest ``local_keep``
(node-local disks are small; milestones live on the remote).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt

from supervisor.backoff import Backoff
from supervisor.format import eventtypes as ev
from supervisor.format.atomic import atomic_write_json
from supervisor.format.capped import RECORD_MAX, read_capped
from supervisor.format.events import typed
from supervisor.format.eventtypes import Event
from supervisor.format.layout import REMOTE_STATUS, RunDir, step_dirname
from supervisor.format.manifest import ManifestError, read_manifest
from supervisor.redact import redact_obj
from supervisor.store import MIN_KEEP, CheckpointRef, StoreError, list_checkpoints, prune
from supervisor.tiers.backends import RemoteConfigError
from supervisor.tiers.events import EmitFn, remote_event_log
from supervisor.tiers.plan import Lag, plan_uploads, upload_lag
from supervisor.tiers.remote import LocalSourceError, LocalUnreadable, RemoteTier, RemoteUnavailable, Transfer

log = logging.getLogger("supervisor.tiers")

BUSY_SKIP = "skip"
BUSY_WAIT = "wait"
SKIPPED_SHOWN = 20


@dataclass(frozen=True)
class UploadPolicy:
    busy: str = BUSY_SKIP
    wait_timeout_s: float = 60.0
    attempts: int = 4  # tries per cycle before the remote is reported down
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    down_retry_s: float = 60.0  # next cycle after a failed one (a submit also starts one)
    remote_keep: int = 5
    milestone_every: int = 0
    local_keep: int | None = 2  # None: the uploader leaves local retention to someone else

    def __post_init__(self) -> None:
        if self.busy not in (BUSY_SKIP, BUSY_WAIT):
            raise RemoteConfigError(f"--remote-busy {self.busy!r} unknown: use {BUSY_SKIP} or {BUSY_WAIT}")
        for flag, keep in (("--remote-keep", self.remote_keep), ("--keep", self.local_keep)):
            if keep is not None and keep < MIN_KEEP:
                raise RemoteConfigError(
                    f"{flag} {keep} refused: keep at least {MIN_KEEP} so a corrupt newest has a fallback"
                )


@dataclass(frozen=True)
class RemoteStatus:
    """What ROOT/supervisor/remote.json says: the remote tier as the uploader last saw it."""

    url: str
    state: str = "starting"  # starting | uploading | in_sync | behind | down
    in_flight: int | None = None
    newest_local: int | None = None
    newest_remote: int | None = None
    lag_steps: int = 0
    lag_s: float = 0.0
    last_success_step: int | None = None
    last_success_time: float | None = None
    last_upload_mb_s: float | None = None
    last_error: str = ""
    last_error_time: float | None = None
    failures: int = 0  # consecutive failed cycles
    skipped: tuple[int, ...] = ()
    updated: float = 0.0


def read_remote_status(root: str | Path) -> RemoteStatus | None:
    """The uploader's last status, or None when there is none (or it is unreadable)."""
    path = RunDir.of(root).remote_status
    try:
        d = json.loads(read_capped(path, RECORD_MAX))
        if not isinstance(d, dict):
            return None
        skipped = d.get("skipped", [])
        if not isinstance(skipped, list) or not all(type(s) is int for s in skipped):
            return None
        return RemoteStatus(**typed(d, _STATUS_TYPES, ""), skipped=tuple(skipped))
    except (OSError, ValueError, TypeError, RecursionError):  # unreadable, garbage, too deep
        return None


# Field types of remote.json, checked on read (events.typed): `status` formats every one.
_STATUS_TYPES = {
    "url": "str",
    "state": "str",
    "in_flight": "int?",
    "newest_local": "int?",
    "newest_remote": "int?",
    "lag_steps": "int",
    "lag_s": "float",
    "last_success_step": "int?",
    "last_success_time": "float?",
    "last_upload_mb_s": "float?",
    "last_error": "str",
    "last_error_time": "float?",
    "failures": "int",
    "updated": "float",
}


class _Stopped(Exception):
    pass


@dataclass
class _Shared:
    """State shared between submit() and the worker, guarded by Uploader._cond."""

    busy: bool = False
    requested: int = 0  # bumped by submit/flush
    synced: int = -1  # last request generation a cycle ended in sync for
    status: RemoteStatus = field(default_factory=lambda: RemoteStatus(url=""))


class Uploader:
    """Background sync of ROOT's committed checkpoints to one remote tier."""

    def __init__(
        self,
        root: str | Path,
        remote: RemoteTier,
        policy: UploadPolicy | None = None,
        *,
        on_event: EmitFn | None = None,
    ) -> None:
        self.root = Path(root)
        self.remote = remote
        self.policy = policy or UploadPolicy()
        self._emit = on_event or remote_event_log(self.root)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._s = _Shared(status=RemoteStatus(url=remote.url))
        self._bad_local: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="ckpt-uploader", daemon=True)

    # ------------------------------------------------------------ trainer-facing

    def start(self) -> Uploader:
        """Start the worker; its first cycle catches up on anything not yet uploaded."""
        self._thread.start()
        self._request()
        return self

    def submit(self, ref: CheckpointRef) -> None:
        """A new local commit is ready. Never raises; blocks only as the busy policy allows."""
        with self._cond:
            busy = self._s.busy
            if busy and self.policy.busy == BUSY_WAIT:
                self._cond.wait_for(lambda: not self._s.busy, timeout=self.policy.wait_timeout_s)
            still_busy = self._s.busy
            in_flight = self._s.status.in_flight
        if busy:
            how = (
                "waited up to the timeout"
                if self.policy.busy == BUSY_WAIT and still_busy
                else self.policy.busy
            )
            log.info("remote: %s ready while step %s uploads (policy %s)", ref.name, in_flight, how)
        self._request()

    def flush(self, timeout_s: float) -> bool:
        """Wait until a cycle started after this call ends in sync (a down remote is retried every
        ``down_retry_s`` meanwhile); False on timeout: the newest checkpoint is then local only."""
        gen = self._request()
        with self._cond:
            return self._cond.wait_for(lambda: self._s.synced >= gen, timeout=timeout_s)

    def close(self, flush_timeout_s: float = 0.0) -> bool:
        """Optionally flush, then stop the worker. An upload still running is abandoned; the next
        run's catch-up finishes it (a remote copy without its manifest is never used)."""
        synced = self.flush(flush_timeout_s) if flush_timeout_s > 0 and self._thread.is_alive() else False
        self._stop.set()
        self._request()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        return synced

    def status(self) -> RemoteStatus:
        with self._cond:
            return self._s.status

    # ------------------------------------------------------------ worker

    def _request(self) -> int:
        with self._cond:
            self._s.requested += 1
            self._cond.notify_all()
            return self._s.requested

    def _run(self) -> None:
        seen = 0
        while not self._stop.is_set():
            with self._cond:
                timeout = self.policy.down_retry_s if self._s.status.state == "down" else None

                def woken(seen: int = seen) -> bool:
                    return self._s.requested > seen or self._stop.is_set()

                self._cond.wait_for(woken, timeout=timeout)
                seen = self._s.requested
            if self._stop.is_set():
                return
            try:
                in_sync = self._cycle()
            except _Stopped:
                return
            except Exception as e:  # the worker must outlive any surprise; training goes on
                log.exception("remote: uploader cycle failed")
                self._update(last_error=f"{e.__class__.__name__}: {e}", last_error_time=time.time())
                in_sync = False
            with self._cond:
                if in_sync:
                    self._s.synced = max(self._s.synced, seen)
                    self._cond.notify_all()

    def _cycle(self) -> bool:
        """Upload until the plan is empty; True when the remote ends in sync."""
        while not self._stop.is_set():
            try:
                remote_steps = [v.step for v in self._retry(self.remote.scan) if v.ok]
            except RemoteUnavailable as e:
                self._down(e)
                self._prune_local()
                return False
            self._reachable()
            local = self._local()
            plan = plan_uploads(
                [s for s in local if s not in self._bad_local], remote_steps, self.policy.milestone_every
            )
            self._note_skipped(plan.skipped)
            lag = upload_lag(local, max(remote_steps, default=None), time.time())
            if not plan.todo:
                self._in_sync(local, remote_steps, lag)
                return True
            if not self._upload_one(plan.todo[0], local, remote_steps, lag):
                return False
        return False

    def _upload_one(self, step: int, local: dict[int, float], remote_steps: list[int], lag: Lag) -> bool:
        ref = CheckpointRef(step, RunDir.of(self.root).checkpoint(step))
        self._set_busy(True)
        self._update(
            state="uploading",
            in_flight=step,
            newest_local=max(local, default=None),
            newest_remote=max(remote_steps, default=None),
            lag_steps=lag.steps,
            lag_s=lag.seconds,
        )
        try:
            t = self._retry(lambda: self.remote.upload(ref))
        except LocalSourceError as e:
            self._local_unusable(ref, e)
            return True
        except LocalUnreadable as e:  # transient: the next cycle (a submit, the final flush) retries
            self._update(in_flight=None, last_error=str(e), last_error_time=time.time())
            self._report(logging.WARNING, ev.UploadDeferred(step=ref.step, reason=str(e)), f"{ref.name}: {e}")
            return False
        except RemoteUnavailable as e:
            self._down(e)
            return False
        finally:
            self._set_busy(False)
        self._success(t)
        return True

    def _retry(self, fn: Callable[[], Any]) -> Any:
        p = self.policy
        return Retrying(
            stop=stop_after_attempt(p.attempts),
            wait=lambda rs: Backoff(p.backoff_initial_s, p.backoff_max_s).wait_s(rs.attempt_number),
            retry=retry_if_exception_type((RemoteUnavailable, LocalUnreadable)),
            sleep=self._sleep,
            before_sleep=self._attempt_failed,
            reraise=True,
        )(fn)

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise _Stopped

    def _attempt_failed(self, rs: RetryCallState) -> None:
        err = rs.outcome.exception() if rs.outcome else None
        wait = rs.next_action.sleep if rs.next_action else 0.0
        log.warning("remote: attempt %d failed (%s); retrying in %.1fs", rs.attempt_number, err, wait)

    # ------------------------------------------------------------ outcomes

    def _local(self) -> dict[int, float]:
        """Committed local steps and their commit wall times."""
        out = {}
        for r in list_checkpoints(self.root):
            try:
                out[r.step] = read_manifest(r.path).wall_time
            except (ManifestError, OSError):
                continue
        return out

    def _reachable(self) -> None:
        st = self.status()
        if st.failures:
            self._report(
                logging.INFO,
                ev.RemoteBack(url=self.remote.url, failed_cycles=st.failures),
                f"remote {self.remote.url} reachable again after {st.failures} failed cycles; catching up",
            )
            self._update(failures=0, state="behind")

    def _success(self, t: Transfer) -> None:
        mb_s = t.bytes / t.seconds / 1e6 if t.seconds > 0 else None
        self._update(
            state="behind",
            in_flight=None,
            last_success_step=t.step,
            last_success_time=time.time(),
            last_upload_mb_s=mb_s,
        )
        self._report(
            logging.INFO,
            ev.UploadOk(step=t.step, bytes=t.bytes, seconds=round(t.seconds, 3)),
            f"{t.name} uploaded to {self.remote.url} ({t.bytes} B in {t.seconds:.2f}s)",
        )

    def _down(self, e: RemoteUnavailable) -> None:
        st = self.status()
        now = time.time()
        local = self._local()
        lag = upload_lag(local, st.newest_remote, now)  # against the last remote step seen
        self._update(
            state="down",
            in_flight=None,
            newest_local=max(local, default=None),
            lag_steps=lag.steps,
            lag_s=lag.seconds,
            last_error=str(e),
            last_error_time=now,
            failures=st.failures + 1,
        )
        msg = (
            f"remote {self.remote.url} unreachable after {self.policy.attempts} attempts ({e}); training "
            f"goes on with local checkpoints, {lag.steps} steps not uploaded; "
            f"retrying every {self.policy.down_retry_s:g}s"
        )
        if st.state != "down":
            self._report(
                logging.WARNING, ev.RemoteDown(url=self.remote.url, error=str(e), lag_steps=lag.steps), msg
            )
        else:
            log.warning("remote: %s", msg)

    def _local_unusable(self, ref: CheckpointRef, e: LocalSourceError) -> None:
        self._update(in_flight=None)
        if not ref.path.exists():  # pruned by local retention mid-upload: the next cycle moves on
            self._report(
                logging.INFO,
                ev.UploadSkipped(step=ref.step, reason="removed locally"),
                f"{ref.name} not uploaded: removed locally before its upload finished",
            )
            return
        self._bad_local.add(ref.step)  # does not match its own manifest: never retried
        self._update(last_error=str(e), last_error_time=time.time())
        self._report(logging.ERROR, ev.UploadRefused(step=ref.step, reason=str(e)), f"not uploaded: {e}")

    def _note_skipped(self, skipped: tuple[int, ...]) -> None:
        known = set(self.status().skipped)
        for s in skipped:
            if s not in known:
                self._report(
                    logging.INFO,
                    ev.UploadSkipped(step=s, reason="superseded by a newer checkpoint"),
                    f"{step_dirname(s)} not uploaded: superseded by a newer checkpoint (busy policy skip)",
                )
        merged = tuple(sorted(known | set(skipped)))[-SKIPPED_SHOWN:]
        self._update(skipped=merged)

    def _in_sync(self, local: dict[int, float], remote_steps: list[int], lag: Lag) -> None:
        try:
            pruned = self._retry(
                lambda: self.remote.prune(self.policy.remote_keep, self.policy.milestone_every)
            )
            if pruned.delete or pruned.clean:
                self._report(
                    logging.INFO,
                    ev.RemotePruned(deleted=list(pruned.delete), cleaned=list(pruned.clean)),
                    f"remote retention: deleted {', '.join(pruned.delete) or 'none'}; "
                    f"cleaned leftovers {', '.join(pruned.clean) or 'none'}",
                )
        except RemoteUnavailable as e:
            log.warning("remote: retention skipped (%s)", e)
        self._prune_local()
        self._update(
            state="in_sync" if lag.steps == 0 else "behind",
            in_flight=None,
            newest_local=max(local, default=None),
            newest_remote=max(remote_steps, default=None),
            lag_steps=lag.steps,
            lag_s=lag.seconds,
        )

    def _prune_local(self) -> None:
        if self.policy.local_keep is None or not self.root.exists():
            return
        try:
            res = prune(self.root, keep=self.policy.local_keep)
        except (StoreError, OSError) as e:
            log.warning("remote: local retention skipped (%s)", e)
            return
        if res.deleted:
            self._report(
                logging.INFO,
                ev.LocalPruned(deleted=list(res.deleted)),
                f"local retention: deleted {', '.join(res.deleted)}",
            )

    def _report(self, level: int, event: Event, msg: str) -> None:
        log.log(level, "remote: %s", msg)
        self._emit(event, msg)

    def _set_busy(self, busy: bool) -> None:
        with self._cond:
            self._s.busy = busy
            self._cond.notify_all()

    def _update(self, **changes: Any) -> None:
        with self._cond:
            self._s.status = replace(self._s.status, updated=time.time(), **changes)
            st = self._s.status
        try:
            atomic_write_json(RunDir.of(self.root).remote_status, redact_obj(asdict(st)), self.root)
        except OSError as e:
            log.warning("remote: cannot write %s (%s)", REMOTE_STATUS, e)
