"""Before every launch: the checkpoint the launch will resume from, chosen as the trainer will choose
it (the newest *valid* one, walking back past corrupt ones, which are quarantined), on the local
tier or across the local and remote tiers. What it walked past goes to the event log; a run that must
not go on raises ``Stop`` (no usable checkpoint while it has history, a mismatch, an unreachable
remote with nothing local past --remote-wait)."""

from __future__ import annotations

import time
from collections.abc import Callable

from supervisor import store
from supervisor.format import confined
from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog
from supervisor.format.exitcodes import Exit
from supervisor.watch.config import WatchConfig
from supervisor.watch.stops import Interrupted, Stop

IO = Callable[[Callable[[], list[store.CheckpointRef]], str], list[store.CheckpointRef]]


class Picker:
    def __init__(
        self,
        cfg: WatchConfig,
        log: EventLog,
        io: IO,
        on_retry: Callable[[str], None],
        sleep: Callable[[float], bool],
    ) -> None:
        """``io``: a listing retried on transient storage errors; ``on_retry``: a pick's retry
        (raises Interrupted on a stop signal); ``sleep``: a backoff that says False when cut short."""
        self.cfg, self.log, self.io, self.on_retry, self.sleep = cfg, log, io, on_retry, sleep
        # quarantine/'s entries as last seen: one that a launch's ranks added (a checkpoint that
        # failed their verify or their load) is logged, with its reason, before the relaunch.
        self.quarantined: set[str] | None = None

    @property
    def how(self) -> str:
        return "deep" if self.cfg.deep_verify else "quick"

    def pick(self, first_launch: bool) -> int | None:
        """Step to resume from (None: from scratch, or a signal cut the pick short: the loop acts
        on it). An unreadable checkpoint is retried for --io-retry, then StorageUnavailable."""
        self._log_quarantined_by_the_ranks()
        if self.cfg.remote:
            return self._across_tiers(self.cfg.remote)
        if first_launch:  # the trainer picks on its first start: only for the record
            refs = self.io(lambda: store.list_checkpoints(self.cfg.root), "listing checkpoints")
            return refs[0].step if refs else None
        try:
            res = store.pick(
                self.cfg.root,
                deep=self.cfg.deep_verify,
                io_retry_s=self.cfg.io_retry_s,
                on_retry=self.on_retry,
                allow_fresh_start=self.cfg.allow_fresh_start,
                key=self.cfg.sign_key,
            )
        except Interrupted:
            return None
        except store.MismatchError as e:
            raise Stop(Exit.CHILD_NONRETRYABLE, f"checkpoint does not match this run: {e}") from None
        except store.NoUsableCheckpoint as e:
            self._log_skipped(e.result)
            raise Stop(Exit.CHILD_NONRETRYABLE, str(e)) from None
        except confined.Escape as e:  # a link planted where the pick must move: a person looks
            raise Stop(Exit.CHILD_NONRETRYABLE, str(e)) from None
        self._log_skipped(res)
        self._note_quarantined()  # what the pick itself moved is logged above, not again
        chosen = res.chosen.ref if res.chosen else None
        msg = (
            f"resume from {chosen.name} ({self.how} check passed)"
            if chosen
            else "no valid checkpoint: start from scratch"
        )
        self.log.emit(ev.Pick(checkpoint=chosen.name if chosen else None, verify=self.how), msg)
        return chosen.step if chosen else None

    def _log_quarantined_by_the_ranks(self) -> None:
        """A ``quarantine`` event for each entry of quarantine/ not there at the last look (the
        first look only takes note): the ranks move a checkpoint aside themselves when its deep
        verify or its load finds it corrupt, and the walk-back that follows is said here, with
        their reason. Best effort: a quarantine that cannot be listed is the pick's to report."""
        before = self.quarantined
        now = self._note_quarantined()
        if now is None or before is None:
            return
        for name in sorted(set(now) - before):
            step, why = name.split("-", 1)[0], now[name]
            self.log.emit(
                ev.Quarantine(checkpoint=step, why=why), f"quarantined {step} (by the ranks): {why}"
            )

    def _note_quarantined(self) -> dict[str, str] | None:
        """quarantine/'s entries now (name -> reason), taken note of for the next look; None when
        it cannot be listed."""
        try:
            now = {q.name: q.reason for q in store.list_quarantined(self.cfg.root)}
        except OSError:
            return None
        self.quarantined = set(now)
        return now

    def _log_skipped(self, res: store.PickResult) -> None:
        """What the pick walked past: quarantined (corrupt) and untrusted (not signed) ones."""
        for name, why in res.quarantined:
            self.log.emit(ev.Quarantine(checkpoint=name, why=why), f"quarantined {name}: {why}")
        for name, why in res.untrusted:
            self.log.emit(ev.Untrusted(checkpoint=name, why=why), f"skipped {name}, not trusted: {why}")

    def _across_tiers(self, url: str) -> int | None:
        """Before every launch, the first included (after node loss nothing is local): the newest
        valid checkpoint of either tier, downloaded when only the remote has it. An unreachable
        remote with nothing valid locally is waited for (backing off), never silently skipped;
        past --remote-wait it is a storage verdict (exit 14), as unreadable local storage is."""
        from supervisor.tiers.remote import RemoteUnavailable, open_remote
        from supervisor.tiers.resume import prepare_resume

        deadline = time.monotonic() + self.cfg.remote_wait_s
        wait = self.cfg.policy.backoff.initial_s or 1.0
        while True:
            try:
                key = self.cfg.sign_key
                res = prepare_resume(
                    self.cfg.root,
                    open_remote(url, self.cfg.remote_endpoint, key=key),
                    deep=self.cfg.deep_verify,
                    on_event=self.log.emit,
                    io_retry_s=self.cfg.io_retry_s,
                    on_retry=self.on_retry,
                    allow_fresh_start=self.cfg.allow_fresh_start,
                    key=key,
                )
            except Interrupted:
                return None
            except store.MismatchError as e:
                raise Stop(Exit.CHILD_NONRETRYABLE, f"checkpoint does not match this run: {e}") from None
            except (store.NoUsableCheckpoint, confined.Escape) as e:
                raise Stop(Exit.CHILD_NONRETRYABLE, str(e)) from None
            except RemoteUnavailable as e:
                # Every failed attempt is logged, the last one too: a slow refusal (client retries)
                # can use up the whole wait in one attempt.
                giving_up = time.monotonic() >= deadline
                then = "giving up" if giving_up else f"retrying in {wait:.0f}s"
                self.log.emit(ev.RemoteUnavailable(), f"{e}; nothing valid locally: {then}")
                if giving_up:
                    raise Stop(
                        Exit.STORAGE_UNAVAILABLE,
                        f"remote {url} unreachable for {self.cfg.remote_wait_s:.0f}s and no "
                        f"valid local checkpoint: {e}",
                    ) from None
                if not self.sleep(wait):
                    return None
                wait = min(wait * 2, self.cfg.policy.backoff.max_s)
                continue
            self._note_quarantined()  # what the pick itself moved it logged itself
            chosen = res.chosen
            msg = (
                f"resume from {chosen.name} ({res.source}, {self.how} check passed)"
                if chosen
                else "no valid checkpoint on either tier: start from scratch"
            )
            self.log.emit(
                ev.Pick(checkpoint=chosen.name if chosen else None, verify=self.how, source=res.source), msg
            )
            return chosen.step if chosen else None
