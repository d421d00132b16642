"""Which checkpoint a launch resumes from: rank 0's quick pick, then a deep verify spread over the
ranks, agreed by all of them, in phase VERIFY with byte progress.

1. Rank 0 asks the store for the newest valid checkpoint with quick checks only (manifest, sizes,
   rank coverage; with ``--remote`` across both tiers) and tells every rank, manifest included.
2. With ``--verify deep``, every rank checksums its share of that checkpoint's files
   (``verify_shares``: on the saved world size, the files it wrote, which are the ones it loads;
   the rest largest first onto the least loaded rank; the same split on every rank from the
   manifest), beating a heartbeat per chunk read with the file named.
3. The ranks exchange their verdicts. All OK: done. A checksum that differs (content evidence):
   rank 0 reads that file again itself (a peer's view alone never moves a checkpoint) and, when
   it differs for rank 0 too, quarantines the checkpoint, and the choice walks back (step 1). A
   file some rank could not read (EIO, ESTALE, not visible from its node): nothing is moved; rank
   0 retries the whole choice with backoff for ``--io-retry`` seconds, then the launch exits 74.

No process hashes a whole checkpoint alone, and nothing is hashed under the store's lock (the
quick pick takes it briefly; the shares are hashed outside it).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from supervisor import store
from supervisor.format import confined
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import ENV_LAUNCH_ID, HeartbeatWriter, Phase
from supervisor.format.layout import step_dirname
from supervisor.format.manifest import Manifest, ManifestError, ProgressFn, read_manifest
from supervisor.resumable import _agree, _tiering
from supervisor.resumable._progress_io import PROGRESS_CHUNK
from supervisor.resumable._tiering import RemoteOptions
from supervisor.store.ioerrors import STORAGE_BACKOFF, Evidence, describe
from supervisor.tiers.remote import RemoteUnavailable

log = logging.getLogger("resumable")

# The remote is unreachable and nothing local is valid: a transient failure, relaunch later.
RETRY_LATER = Exit(1)


class Batch(Protocol):
    """What the resume checks of a run's config itself: the global batch the data position counts
    (``config.TrainConfig``, ``resumable.Identity``)."""

    @property
    def name(self) -> str: ...

    @property
    def global_batch(self) -> int: ...


@dataclass(frozen=True)
class Request:
    """What the choice reads: the run directory and the resume options (``resumable.resume_args``)."""

    ckpt_root: Path
    verify: str = "deep"
    io_retry: float = store.IO_RETRY_S
    allow_fresh_start: bool = False
    sign_key: bytes | None = field(default=None, repr=False)
    load_step: int | None = None
    identity: Mapping[str, Any] | None = None  # this run's, named in a mismatch refusal
    remote: RemoteOptions | None = None  # with --remote only


@dataclass(frozen=True)
class Choice:
    """Rank 0's decision, broadcast to every rank: which checkpoint, or why none may be used."""

    launch: str
    ckpt: Path | None = None
    world_size: int = 0
    error: str = ""
    code: Exit = Exit.OK
    manifest: Manifest | None = None
    verified: bool = False  # its checksums were already checked (a download from the remote)


@dataclass(frozen=True)
class ShareVerdict:
    """One rank's verdict on its share of the chosen checkpoint (picklable)."""

    rank: int
    evidence: Evidence
    reason: str = ""
    name: str = ""  # the file the verdict is about (relative to the checkpoint)
    error: OSError | None = None


# ---------------------------------------------------------------- pure parts


def split_by_size(
    sizes: Mapping[str, int], ranks: int, given: Sequence[Collection[str]] = ()
) -> list[list[str]]:
    """Files per rank: those ``given`` to each rank (by rank), then the others largest first,
    each onto the rank with the fewest bytes so far (ties: lower rank), names sorted within a
    share. Deterministic, so every rank computes the same split without a message; with nothing
    given, the largest share exceeds the ideal (total / ranks) by less than the largest file."""
    shares = [[n for n in given[r] if n in sizes] if r < len(given) else [] for r in range(ranks)]
    load = [sum(sizes[n] for n in share) for share in shares]
    taken = {n for share in shares for n in share}
    for name in sorted(sizes.keys() - taken, key=lambda n: (-sizes[n], n)):
        r = min(range(ranks), key=lambda i: (load[i], i))
        shares[r].append(name)
        load[r] += sizes[name]
    return [sorted(s) for s in shares]


def verify_shares(m: Manifest, ranks: int) -> list[list[str]]:
    """Files per rank for a spread verify of ``m``. On the world size that saved it, each rank
    checks the files it wrote (``m.writers``): the ones it loads next, so on a node of its own its
    load finds them in the page cache instead of reading them a second time (a cold load ran at
    1.8 GB/s here, a hot one at 2.8; over a network file system the bytes read twice cost
    more). The rest, and everything on another world size or without ``writers``, by size."""
    own = [m.writers.get(r, ()) for r in range(ranks)] if m.world_size == ranks else []
    return split_by_size({n: e.size for n, e in m.files.items()}, ranks, own)


def combine(verdicts: list[ShareVerdict]) -> ShareVerdict:
    """The verdict of all ranks: corrupt when any rank has content evidence (it outranks a peer
    that could not read), else unknown when any could not read, else OK."""
    for ev in (Evidence.CORRUPT, Evidence.UNKNOWN):
        for v in verdicts:
            if v.evidence is ev:
                return v
    return verdicts[0]


# ---------------------------------------------------------------- the choice, on every rank


class Interrupted(Exception):
    """A preemption notice (SIGTERM...) arrived while this rank verified: it stops at the next
    chunk read instead of hashing on, however long the files (the caller exits 75)."""


def choose_checkpoint(
    args: Request,
    expect: store.Expectation,
    cfg: Batch,
    hb: HeartbeatWriter,
    stop: Callable[[], bool] = lambda: False,
) -> Choice:
    """Every rank: the checkpoint to load (verified as ``--verify`` says), or why none may be.
    ``stop()``: a preemption notice arrived (the trainer's signal handlers only record it):
    checked at every chunk hashed, Interrupted then.

    Ends back in phase STARTUP: what comes next until the load (building the model, the optimizer,
    the parallel wrappers: seconds, minutes for a large model, without a beat) is startup work,
    held to the startup timeout, not to the verify timeout of the last file checked."""
    choice = _choose_verified(args, expect, cfg, hb, stop)
    hb.beat(0, Phase.STARTUP, force=True)
    return choice


def _stoppable(progress: ProgressFn, stop: Callable[[], bool]) -> ProgressFn:
    """``progress``, raising Interrupted once ``stop()`` says a notice arrived."""

    def tick(n: int) -> None:
        if stop():
            raise Interrupted()
        progress(n)

    return tick


def _choose_verified(
    args: Request, expect: store.Expectation, cfg: Batch, hb: HeartbeatWriter, stop: Callable[[], bool]
) -> Choice:
    rank0 = dist.get_rank() == 0
    retry = _Retry(args.ckpt_root, args.io_retry) if rank0 else None
    launch = (
        (os.environ.get(ENV_LAUNCH_ID) or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}") if rank0 else ""
    )

    def beat() -> None:  # ranks but 0 wait for its choice; rank 0 for the others to take it
        hb.beat(0, Phase.VERIFY, waiting="rank 0's choice of a checkpoint")

    def on_retry(msg: str) -> None:
        log.warning("resume: %s", msg)
        hb.beat(0, Phase.VERIFY, waiting="storage: a retry of the pick")

    while True:
        hb.beat(0, Phase.VERIFY, force=True)
        mine = None
        if retry is not None:
            progress = _stoppable(hb.tracker(Phase.VERIFY, 0), stop) if args.sign_key is not None else None
            mine = retry.gave_up or _choose(args, expect, cfg, launch, on_retry, progress)
        choice: Choice = _agree.broadcast(mine, None, beat)
        if choice.error or choice.ckpt is None or choice.verified or args.verify != "deep":
            return choice
        v = verify_spread(choice, args.ckpt_root, hb, stop)
        if v.evidence is Evidence.OK:
            return choice
        if retry is not None:
            retry.failed(choice, v)


SHARES = "every rank's verdict on its share of the verify"


def verify_spread(
    choice: Choice, root: Path, hb: HeartbeatWriter, stop: Callable[[], bool] = lambda: False
) -> ShareVerdict:
    """Every rank checks its share of ``choice``'s files; the combined verdict, on every rank.
    Interrupted at the first chunk after ``stop()`` says a preemption notice arrived."""
    assert choice.ckpt is not None and choice.manifest is not None
    m = choice.manifest
    rank, world = dist.get_rank(), dist.get_world_size()
    names = verify_shares(m, world)[rank]
    ref = store.CheckpointRef(m.step, choice.ckpt)
    progress = hb.tracker(Phase.VERIFY, m.step, total=sum(m.files[n].size for n in names))
    mine = ShareVerdict(rank, Evidence.OK)
    for name in names:
        progress.set_path(os.path.relpath(choice.ckpt / name, root))
        v = store.check_files(ref, m, [name], _stoppable(progress, stop), chunk=PROGRESS_CHUNK)
        if not v.ok:
            mine = ShareVerdict(rank, v.evidence, v.reason, name, v.error)
            break
    progress.set_path("")  # waiting for the peers now, not in a read
    verdicts = _agree.gather_to_root(mine, None, lambda: progress.wait(SHARES))
    return _agree.broadcast(
        None if verdicts is None else combine(verdicts), None, lambda: progress.wait(SHARES)
    )


class _Retry:
    """Rank 0's side of a verify that did not pass: quarantine on evidence confirmed by rank 0,
    backoff on a read error, and the error Choice once the retry time is over."""

    def __init__(self, root: Path, io_retry_s: float) -> None:
        self.root, self.io_retry_s = root, io_retry_s
        self.first_unknown: float | None = None
        self.attempt = 0
        self.rng = random.Random()
        self.gave_up: Choice | None = None

    def failed(self, choice: Choice, v: ShareVerdict) -> None:
        assert choice.ckpt is not None and choice.manifest is not None
        ref = store.CheckpointRef(choice.manifest.step, choice.ckpt)
        if v.evidence is Evidence.CORRUPT:
            mine = v if v.rank == 0 else self._confirm(ref, choice.manifest, v)
            if mine.evidence is Evidence.CORRUPT:
                try:
                    store.quarantine(self.root, ref, mine.reason)
                except OSError as e:
                    v = ShareVerdict(
                        0, Evidence.UNKNOWN, f"{ref.name}: not quarantined ({describe(e)})", error=e
                    )
                else:
                    log.warning("deep verify: %s quarantined (%s); walking back", ref.name, mine.reason)
                    self.first_unknown, self.attempt = None, 0
                    return
            else:
                v = mine
        self._unknown(choice, v)

    def _confirm(self, ref: store.CheckpointRef, m: Manifest, v: ShareVerdict) -> ShareVerdict:
        """Rank 0 reads the file a peer found corrupt; what rank 0 reads decides."""
        mine = store.check_files(ref, m, [v.name])
        if mine.evidence is Evidence.CORRUPT:
            return ShareVerdict(0, Evidence.CORRUPT, mine.reason, v.name)
        why = mine.reason or f"{ref.name}: {v.name} reads fine from rank 0"
        return ShareVerdict(
            0,
            Evidence.UNKNOWN,
            f"rank {v.rank} saw {v.reason!r} but rank 0 does not ({why}): not proof of corruption",
            v.name,
            mine.error,
        )

    def _unknown(self, choice: Choice, v: ShareVerdict) -> None:
        assert choice.ckpt is not None
        now = time.monotonic()
        self.first_unknown = self.first_unknown if self.first_unknown is not None else now
        elapsed = now - self.first_unknown
        where = v.error.filename if v.error is not None and v.error.filename else choice.ckpt / v.name
        if elapsed >= self.io_retry_s:
            fix = store.unreadable_fix(self.root, where)
            self.gave_up = Choice(
                choice.launch,
                error=f"rank {v.rank}: {v.reason} for {elapsed:.0f}s of retries (deep verify); {fix}",
                code=Exit.STORAGE,
            )
            return
        self.attempt += 1
        wait = min(STORAGE_BACKOFF.wait_s(self.attempt, self.rng), max(0.0, self.io_retry_s - elapsed))
        log.warning(
            "resume: rank %d: %s, not proof of corruption; retrying the choice in %.1fs (%.0fs of %.0fs)",
            v.rank,
            v.reason,
            wait,
            elapsed,
            self.io_retry_s,
        )
        time.sleep(wait)


def _choose(
    args: Request,
    expect: store.Expectation,
    cfg: Batch,
    launch: str,
    on_retry: Callable[[str], None] | None = None,
    progress: ProgressFn | None = None,
) -> Choice:
    """Rank 0: the store's quick pick (walk-back, quarantine, compatibility; with --remote across
    both tiers first), as a Choice; errors become the Choice's error and exit code. With
    --signing-key and --verify deep, the store's signed deep check runs here, on rank 0, with
    ``progress`` (it checks every file's SHA-256 against the signature, and walks past a
    checkpoint it does not trust, which a spread verify could not make the quick pick do)."""
    root = args.ckpt_root
    on_retry = on_retry or (lambda msg: log.warning("resume: %s", msg))
    signed_deep = args.verify == "deep" and args.sign_key is not None
    try:
        v, downloaded = _picked(args, expect, on_retry, progress)
    except store.MismatchError as e:
        return Choice(launch, error=str(e) + mismatch_fields(root, args.identity), code=Exit.MISMATCH)
    except (store.StoreError, store.StorageUnavailable, RemoteUnavailable, OSError) as e:
        return Choice(launch, error=_one_line(e, root), code=_refusal_code(e))
    if v is None or v.manifest is None:
        return Choice(launch)
    problem = batch_problem(v.ref.name, v.manifest.parallelism.get("global_batch"), cfg)
    if problem:
        return Choice(launch, error=problem, code=Exit.BAD_CONFIG)
    # Deep-checked already: signed, or downloaded just now (every checksum checked on the way).
    verified = signed_deep or v.ref.step == downloaded
    return Choice(launch, v.ref.path, v.manifest.world_size, manifest=v.manifest, verified=verified)


def _picked(
    args: Request, expect: store.Expectation, on_retry: Callable[[str], None], progress: ProgressFn | None
) -> tuple[store.Verdict | None, int | None]:
    """The chosen checkpoint's verdict (None: none) and the step downloaded for it (None: none)."""
    root = args.ckpt_root
    signed_deep = args.verify == "deep" and args.sign_key is not None
    downloaded = None
    if args.remote is not None:
        tiers = _tiering.resume(
            root,
            args.remote,
            expect,
            deep=signed_deep,
            key=args.sign_key,
            io_retry_s=args.io_retry,
            allow_fresh_start=args.allow_fresh_start,
            on_retry=on_retry,
        )
        downloaded = tiers.chosen.step if tiers.source == "remote" and tiers.chosen else None
    if args.load_step is not None:
        return pick_step(root, args.load_step, expect, args.sign_key), downloaded
    res = store.pick(
        root,
        deep=signed_deep and args.remote is None,  # with --remote, checked by the tier resume
        expect=expect,
        progress=progress,
        io_retry_s=args.io_retry,
        on_retry=on_retry,
        allow_fresh_start=args.allow_fresh_start,
        key=args.sign_key,
    )
    for name, why in res.untrusted:  # skipped and left where it is: said, never silently
        log.warning("resume: skipped %s, not trusted: %s", name, why)
    return res.chosen, downloaded


def _refusal_code(e: Exception) -> Exit:
    """The exit of a pick that raised ``e``."""
    if isinstance(e, confined.Escape):  # a link planted in the run directory: a person must look
        return Exit.UNTRUSTED
    if isinstance(e, store.NoUsableCheckpoint):
        return Exit.NO_USABLE_CHECKPOINT
    if isinstance(e, store.StorageUnavailable | OSError):  # OSError: not transient (those were retried)
        return Exit.STORAGE
    if isinstance(e, RemoteUnavailable):
        return RETRY_LATER
    return Exit.BAD_CONFIG  # another StoreError


def _one_line(e: Exception, root: Path) -> str:
    if isinstance(e, OSError) and not isinstance(e, confined.Escape):
        return f"{e.filename or root}: {describe(e)}"
    return str(e)


def batch_problem(name: str, saved: object, cfg: Batch) -> str:
    """The sampler's position counts global batches, so it cannot map onto another global batch
    size (not even with --allow-config-change): one line naming both values, or ''. A manifest
    whose global batch is not a number (``"eight"``) says so, one line."""
    if saved is None or saved == cfg.global_batch:
        return ""
    if isinstance(saved, bool) or not isinstance(saved, int):
        return (
            f"{name}: its manifest's parallelism.global_batch is {str(saved)[:40]!r}, not a number: "
            f"not a manifest this toolkit wrote; move it aside with `python -m supervisor ckpt quarantine`"
        )
    return (
        f"{name} was saved with global batch {saved} but config '{cfg.name}' has global batch "
        f"{cfg.global_batch}; the data position cannot carry over: use a config with global batch "
        f"{saved}, or start a new --ckpt-root"
    )


# ---------------------------------------------------------------- --load-step and identity


def pick_step(root: Path, step: int, expect: store.Expectation, key: bytes | None) -> store.Verdict:
    """Rank 0, ``--load-step N``: that committed checkpoint (quick checks, compatibility), or a
    one-line StoreError. The committed checkpoints after it belong to the abandoned future: they
    are quarantined (moved aside, never deleted), so neither this run's next saves nor a later
    pick land on them."""
    refs = store.list_checkpoints(root)
    ref = next((r for r in refs if r.step == step), None)
    if ref is None:
        have = ", ".join(str(r.step) for r in reversed(refs)) or "none"
        raise store.StoreError(
            f"--load-step {step}: no committed {step_dirname(step)} in {root} (committed steps: {have}); "
            "give one of them, or leave --load-step out to resume from the newest"
        )
    v = store.validate(ref, key=key)
    if not v.ok:
        raise store.StoreError(
            f"--load-step {step}: {v.reason}; give another step (ckpt list --ckpt-root {root})"
        )
    store.check_compatible(v, expect)
    for newer in (r for r in refs if r.step > step):
        store.quarantine(
            root, newer, f"rolled back: a launch with --load-step {step} resumed from {ref.name}"
        )
        log.warning("--load-step %d: %s moved to quarantine/ (a future this run abandoned)", step, newer.name)
    return v


def identity_diff(saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The identity fields that differ: name -> (saved, now); a field one side lacks is None there."""
    return {
        k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)
    }


def describe_diff(diff: Mapping[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in diff.items())


def mismatch_fields(root: Path, identity: Mapping[str, Any] | None) -> str:
    """' (fields that differ: seed 7 -> 8)' from the newest readable checkpoint's recorded identity
    (the pick refused the newest valid one), or '' when it records none (an older checkpoint) or
    none can be read: the hashes alone still say that it differs."""
    if identity is None:
        return ""
    for ref in store.list_checkpoints(root):
        try:
            saved = read_manifest(ref.path).meta.get("identity")
        except (OSError, ManifestError):
            continue
        diff = identity_diff(saved, identity) if isinstance(saved, dict) else {}
        return f" (fields that differ: {describe_diff(diff)})" if diff else ""
    return ""
