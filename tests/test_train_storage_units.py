"""The trainer's storage decisions and I/O helpers, without a process group: the give-up policy, a
failed save's one line, the buffered log appender on a real full tmpfs, the split of a spread deep
verify, and the reader that counts the bytes DCP reads."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from waiting import PATIENCE_S

from supervisor import store
from supervisor.format.appender import LineAppender
from supervisor.format.heartbeat import (
    DEFAULT_COMMIT_TIMEOUT_S,
    DEFAULT_SAVE_TIMEOUT_S,
    ENV_PHASE_TIMEOUTS,
    Phase,
)
from supervisor.format.layout import dcp_shard_filename, rank_state_filename
from supervisor.format.manifest import FileEntry, Manifest, checksum_file
from supervisor.resumable import _progress_io
from supervisor.resumable._bounds import phase_timeouts, wait_bound_s
from supervisor.resumable._progress_io import (
    MAX_WRITE_CHUNK,
    MIN_WRITE_CHUNK,
    PEERS_IN_DCP,
    PROGRESS_CHUNK,
    WRITE_CHUNK_S,
    WRITEBACK_CHUNK,
    Hashed,
    Keepalive,
    ProgressFileSystem,
    Relay,
    next_write_chunk,
    start_writeback,
    wait_forwarding,
    written_key,
)
from supervisor.resumable._resume import ShareVerdict, combine, split_by_size, verify_shares
from supervisor.resumable._safe_load import load_dcp
from supervisor.resumable._save_policy import (
    SavePolicy,
    dcp_save_error,
    failure_line,
    give_up,
    save_error,
    storage_cause,
)
from supervisor.resumable._shard_writer import shard_writer
from supervisor.resumable._staging import CPU_STAGING, OrderedStager
from supervisor.store.ioerrors import Evidence

# ---------------------------------------------------------------- give-up policy


@pytest.mark.parametrize(
    ("failures", "unsaved_s", "policy", "stops"),
    [
        (0, 1e9, SavePolicy(3, 10), ""),  # saves succeed: never stop, however long ago
        (1, 5.0, SavePolicy(3, 0), ""),
        (2, 1e9, SavePolicy(3, 0), ""),  # no time limit by default
        (3, 0.0, SavePolicy(3, 0), "3 saves failed in a row (--max-failed-saves 3)"),
        (1, 0.0, SavePolicy(1, 0), "1 saves failed in a row (--max-failed-saves 1)"),
        (1, 9.9, SavePolicy(3, 10), ""),
        (
            1,
            10.0,
            SavePolicy(3, 10),
            "no durable checkpoint for 10s after 1 failed save (--max-unsaved-s 10)",
        ),
        (
            2,
            60.0,
            SavePolicy(3, 30),
            "no durable checkpoint for 60s after 2 failed saves (--max-unsaved-s 30)",
        ),
        (3, 60.0, SavePolicy(3, 30), "3 saves failed in a row (--max-failed-saves 3)"),  # whichever first
    ],
)
def test_give_up_after_n_failures_or_t_seconds_whichever_first(failures, unsaved_s, policy, stops):
    assert give_up(policy, failures, unsaved_s) == stops


@pytest.mark.parametrize(
    ("policy", "flag"),
    [(SavePolicy(0, 0), "--max-failed-saves 0"), (SavePolicy(3, -1), "--max-unsaved-s -1")],
)
def test_impossible_policies_are_refused_naming_the_flag(policy, flag):
    assert policy.problem().startswith(flag) and "\n" not in policy.problem()
    assert SavePolicy().problem() == ""


# ---------------------------------------------------------------- what a failed save says


def test_a_failed_write_names_rank_file_and_errno_relative_to_the_run_dir(tmp_path):
    e = OSError(
        errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "step_00000020.tmp.1.h" / "__1_0.distcp")
    )
    assert str(save_error(e, 1, tmp_path)) == (
        "rank 1: step_00000020.tmp.1.h/__1_0.distcp: ENOSPC (No space left on device)"
    )
    assert str(save_error(OSError(errno.EIO, "Input/output error"), 0, tmp_path)) == (
        "rank 0: EIO (Input/output error)"
    )
    inc = store.IncompleteCommit(
        f"{tmp_path}/step_00000020.tmp.1.h: __1_0.distcp written by rank 1 is missing"
    )
    assert (
        str(save_error(inc, 0, tmp_path))
        == "rank 0: step_00000020.tmp.1.h: __1_0.distcp written by rank 1 is missing"
    )


def _wrapped(exc: BaseException) -> tuple:
    try:
        raise exc
    except BaseException as e:
        return _wrap_exception(e)


def test_dcp_failures_are_storage_failures_only_when_every_rank_failed_on_storage(tmp_path):
    def enospc(rank: int) -> OSError:
        return OSError(errno.ENOSPC, "No space left on device", str(tmp_path / f"__{rank}_0.distcp"))

    both = CheckpointException("write", {1: _wrapped(enospc(1)), 0: _wrapped(enospc(0))})
    assert (
        str(dcp_save_error(both, tmp_path))
        == "rank 0: __0_0.distcp: ENOSPC (No space left on device) (and 1 more rank)"
    )
    # torch's serializer reports a failed stream write as a RuntimeError raised while handling it
    try:
        try:
            raise enospc(1)
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from None
    except RuntimeError as e:
        wrapped_runtime = _wrap_exception(e)
    assert storage_cause(wrapped_runtime[0]) is None  # `from None` hides the context: not storage
    ctx = RuntimeError("unexpected pos")
    ctx.__context__ = enospc(1)
    assert str(dcp_save_error(CheckpointException("write", {1: (ctx, None)}), tmp_path)) == (
        "rank 1: __1_0.distcp: ENOSPC (No space left on device)"
    )
    bug = CheckpointException("write", {0: _wrapped(enospc(0)), 1: _wrapped(TypeError("bad plan"))})
    assert dcp_save_error(bug, tmp_path) is None  # a bug anywhere crashes the save, it is not retried


def test_the_failure_warning_is_one_line_with_step_rank_file_errno_and_what_happens():
    line = failure_line(
        20, "rank 1: x/__1_0.distcp: ENOSPC (No space left on device)", 1, "step_00000010", SavePolicy()
    )
    assert "\n" not in line
    for part in (
        "step 20",
        "rank 1",
        "__1_0.distcp",
        "ENOSPC",
        "latest is still step_00000010",
        "stops at 3",
    ):
        assert part in line, part


def _held_by_the_writer(tmp: Path, root: Path) -> OSError:
    """What the writer held back from a save on a full disk: DCP itself ran to its end."""
    writer = shard_writer(tmp, root)
    dcp.save({"w": torch.randn(100_000)}, storage_writer=writer)  # raises nothing: held back
    with pytest.raises(OSError) as e:
        writer.raise_held()
    return e.value


def test_a_real_full_disk_under_dcp_names_the_shard_and_enospc(small_tmpfs):
    """The writer holds the failure back until DCP is done (a rank that left DCP early left its
    peers in DCP's barrier: issue 44), then it is raised naming the shard and the errno."""
    root = small_tmpfs.path
    tmp = root / "step_00000005.tmp.1.h"
    tmp.mkdir()
    small_tmpfs.fill()
    e = _held_by_the_writer(tmp, root)
    assert (
        str(save_error(e, 0, root))
        == "rank 0: step_00000005.tmp.1.h/__0_0.distcp: ENOSPC (No space left on device)"
    )


def test_a_disk_that_fills_mid_shard_is_a_storage_failure_on_every_rank(small_tmpfs):
    """With a few pages free, the shard's open succeeds and a later write fails: torch's serializer
    then raises "unexpected pos" while handling the ENOSPC. What the rank holds and reports must
    still be the ENOSPC on the shard, or every rank crashes on a full disk it should ride out (the
    drill's disk-full, freed mid-save)."""
    root = small_tmpfs.path
    tmp = root / "step_00000005.tmp.1.h"
    tmp.mkdir()
    small_tmpfs.fill()
    os.truncate(small_tmpfs.filler, os.path.getsize(small_tmpfs.filler) - 8192)  # two pages free
    e = _held_by_the_writer(tmp, root)
    assert (
        str(save_error(e, 0, root))
        == "rank 0: step_00000005.tmp.1.h/__0_0.distcp: ENOSPC (No space left on device)"
    )


# ---------------------------------------------------------------- the buffered appender


def test_lines_written_while_the_disk_is_full_arrive_in_order_once_it_is_freed(small_tmpfs):
    path = small_tmpfs.path / "metrics.jsonl"
    log = LineAppender(path, path.parent)
    lines = [json.dumps({"step": s, "pad": "x" * 5000}) for s in (1, 2, 3, 4)]  # > a page each
    assert log.append(lines[0])
    small_tmpfs.fill()
    assert not log.append(lines[1]) and not log.append(lines[2])
    # what landed is a prefix of the stream (a full tmpfs still fills the page a file started)
    queued = "".join(x + "\n" for x in lines[:3])
    landed = path.read_text()
    assert landed.startswith(lines[0] + "\n") and queued.startswith(landed) and len(landed) < len(queued)
    small_tmpfs.free()
    assert log.append(lines[3])
    log.close()
    assert path.read_text() == "".join(x + "\n" for x in lines)


def test_a_short_write_resumes_where_it_stopped_and_no_byte_is_written_twice(small_tmpfs):
    path = small_tmpfs.path / "samples.jsonl"
    log = LineAppender(path, path.parent)
    small_tmpfs.fill()
    os.truncate(small_tmpfs.filler, os.path.getsize(small_tmpfs.filler) - 8192)  # two pages free
    big = json.dumps({"step": 1, "ids": list(range(10_000))})  # ~59 kB: lands in part only
    assert not log.append(big)
    landed = path.read_bytes()
    assert 0 < len(landed) < len(big)  # a real short write
    small_tmpfs.free()
    assert log.flush()
    log.close()
    assert path.read_text() == big + "\n"


def test_a_line_left_half_written_by_a_killed_writer_does_not_swallow_the_next(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # killed mid-line
    log = LineAppender(path, path.parent)
    log.append(json.dumps({"step": 3}))
    log.close()
    assert path.read_text().splitlines()[-1] == '{"step": 3}'


# ---------------------------------------------------------------- spread verify


def test_the_split_balances_bytes_largest_first():
    sizes = {
        ".metadata": 40,
        "__0_0.distcp": 280,
        "__1_0.distcp": 285,
        "rank_00000.state.pt": 17,
        "rank_00001.state.pt": 17,
    }
    shares = split_by_size(sizes, 2)
    # 285 -> r0, 280 -> r1, 40 -> r1 (320), 17 -> r0 (302), 17 -> r0 (319 < 320)
    assert shares == [
        ["__1_0.distcp", "rank_00000.state.pt", "rank_00001.state.pt"],
        [".metadata", "__0_0.distcp"],
    ]
    assert split_by_size(sizes, 1) == [sorted(sizes)]
    assert split_by_size({"a": 1}, 3) == [["a"], [], []]


def _written(world: int) -> Manifest:
    """A checkpoint of ``world`` ranks as the trainer commits it: rank 0 wrote DCP's index, each
    rank its shard and its RNG file; shards of uneven sizes."""
    files = {".metadata": FileEntry(40, "x")}
    writers: dict[int, tuple[str, ...]] = {}
    for r in range(world):
        mine = (dcp_shard_filename(r), rank_state_filename(r))
        files |= {mine[0]: FileEntry(100 + 50 * r, "x"), mine[1]: FileEntry(17, "x")}
        writers[r] = mine + ((".metadata",) if r == 0 else ())
    return Manifest(step=10, world_size=world, files=files, writers=writers)


def test_on_the_saved_world_size_each_rank_verifies_what_it_wrote_and_loads_next():
    m = _written(2)
    assert verify_shares(m, 2) == [sorted(m.writers[0]), sorted(m.writers[1])]
    # by size alone, each rank would read the other's shard: its load would then read its own cold
    by_size = split_by_size({n: e.size for n, e in m.files.items()}, 2)
    assert dcp_shard_filename(1) in by_size[0] and dcp_shard_filename(0) in by_size[1]


def test_on_another_world_size_or_without_writers_the_split_is_by_size():
    m = _written(2)
    sizes = {n: e.size for n, e in m.files.items()}
    assert verify_shares(m, 3) == split_by_size(sizes, 3)
    assert verify_shares(replace(m, writers={}), 2) == split_by_size(sizes, 2)


def test_files_no_rank_wrote_go_by_size_after_the_given_ones():
    sizes = {"a": 10, "b": 1, "c": 5, "d": 4}
    # given a -> r0, b -> r1: c (5) onto r1 (1), d (4) onto r1 (6) < r0 (10)
    assert split_by_size(sizes, 2, [["a"], ["b"]]) == [["a"], ["b", "c", "d"]]
    assert split_by_size(sizes, 2, [["a", "gone"]]) == [["a"], ["b", "c", "d"]]  # a name not listed


@given(
    st.dictionaries(st.text("abcdef_.0123", min_size=1, max_size=8), st.integers(0, 10**9), max_size=40),
    st.integers(1, 16),
)
def test_every_file_is_checked_once_and_no_share_exceeds_the_ideal_by_a_file(sizes, ranks):
    shares = split_by_size(sizes, ranks)
    assert len(shares) == ranks
    assert sorted(n for s in shares for n in s) == sorted(sizes)
    if sizes:
        loads = [sum(sizes[n] for n in s) for s in shares]
        assert max(loads) <= sum(sizes.values()) / ranks + max(sizes.values())
    assert split_by_size(dict(reversed(list(sizes.items()))), ranks) == shares  # the same on every rank


def test_corrupt_outranks_unknown_outranks_ok():
    ok, unk, bad = (
        ShareVerdict(0, Evidence.OK),
        ShareVerdict(1, Evidence.UNKNOWN, "EIO", "__1_0.distcp"),
        ShareVerdict(2, Evidence.CORRUPT, "checksum", "__2_0.distcp"),
    )
    assert (
        combine([ok, unk, bad]) is bad
        and combine([unk, ok]) is unk
        and combine([ok, ok]).evidence is Evidence.OK
    )


# ---------------------------------------------------------------- the progress reader


def test_the_progress_reader_counts_what_dcp_reads_a_chunk_at_a_time(tmp_path, tracker):
    ckpt = tmp_path / "step_00000001"
    saved = {"w": torch.randn(300_000), "b": torch.arange(10)}
    dcp.save(saved, storage_writer=shard_writer(ckpt, tmp_path))
    loaded = {"w": torch.zeros(300_000), "b": torch.zeros(10, dtype=torch.int64)}
    load_dcp(ckpt, loaded, None, fs=ProgressFileSystem(tmp_path, tracker))
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["b"], saved["b"])
    shard = os.path.getsize(ckpt / "__0_0.distcp")
    assert sum(tracker.units) >= shard  # every byte of the shard went through the counter
    # read straight into the tensors (direct_read.py): the first read a counted chunk, the next
    # sized to the rate as counted writes are, none above the largest
    reads = [n for n in tracker.units if n]
    assert reads[0] <= PROGRESS_CHUNK and max(reads) <= MAX_WRITE_CHUNK and len(reads) >= 2
    # each file named while it is looked for or read, cleared after (between files): DCP's one
    # index is looked for first (else each rank reads its own, dcp_index.py)
    index = "step_00000001/.metadata"
    assert tracker.paths == [index, "", index, "", "step_00000001/__0_0.distcp", ""]


def test_the_progress_writer_counts_what_dcp_writes_a_chunk_at_a_time(tmp_path, tracker):
    """A save beats while its bytes move (a sync save into the loop's heartbeat, an async upload
    into its relay), naming the file it writes: a slow write is no hang, a stuck one is named."""
    ckpt = tmp_path / "step_00000001"
    saved = {"w": torch.randn(1_000_000), "b": torch.arange(10)}  # 4 MB: several chunks
    dcp.save(saved, storage_writer=shard_writer(ckpt, tmp_path, tracker))
    written = sum(os.path.getsize(ckpt / n) for n in ("__0_0.distcp", ".metadata"))
    assert sum(tracker.units) == written  # every byte DCP wrote went through the counter
    assert max(tracker.units) <= MAX_WRITE_CHUNK and len(tracker.units) >= written // MAX_WRITE_CHUNK
    named = [p for p in tracker.paths if p]  # the directory made, the shard, DCP's index renamed into place
    assert named[0] == "step_00000001" and "step_00000001/__0_0.distcp" in named, named
    assert named[-1].startswith("step_00000001/.metadata") and tracker.paths[-1] == "", tracker.paths
    loaded = {"w": torch.zeros(1_000_000), "b": torch.zeros(10, dtype=torch.int64)}
    load_dcp(ckpt, loaded, None, fs=ProgressFileSystem(tmp_path))
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["b"], saved["b"])


@pytest.mark.parametrize("digest", [False, True], ids=["checksums", "and-sha256"])
def test_what_dcp_writes_is_hashed_as_it_is_written_under_the_name_it_ends_with(tmp_path, tracker, digest):
    """A commit takes DCP's files' checksums from the writes (no read back): each is the file's,
    the index under the name it was renamed to; with a signing key (``digest``) their SHA-256 too."""
    ckpt = tmp_path / "step_00000001"
    writer = shard_writer(ckpt, tmp_path, tracker, digest)
    dcp.save({"w": torch.randn(1_000_000), "b": torch.arange(10)}, storage_writer=writer)
    on_disk = {
        written_key(ckpt / n): Hashed(
            FileEntry(os.path.getsize(ckpt / n), checksum_file(ckpt / n)),
            hashlib.sha256((ckpt / n).read_bytes()).hexdigest() if digest else None,
        )
        for n in ("__0_0.distcp", ".metadata")
    }
    assert writer.written == on_disk


def test_a_file_written_out_of_order_or_not_to_its_end_is_not_hashed_as_written(tmp_path, tracker):
    fs = ProgressFileSystem(tmp_path, tracker)
    with fs.create_stream(tmp_path / "a", "wb") as f:
        f.write(b"x" * 10)
        f.seek(0)
        f.write(b"y")  # a write back into what was written: only a read back knows the file
    with pytest.raises(OSError), fs.create_stream(tmp_path / "b", "wb") as f:
        f.write(b"x" * 10)
        raise OSError(errno.EIO, "failed mid-file")
    with fs.create_stream(tmp_path / "c", "wb") as f:
        f.write(b"z" * 10)
    assert list(fs.written) == [written_key(tmp_path / "c")]
    fs.rename(tmp_path / "c", tmp_path / "d")
    assert fs.written == {written_key(tmp_path / "d"): Hashed(FileEntry(10, checksum_file(tmp_path / "d")))}
    fs.rm_file(tmp_path / "d")
    assert fs.written == {}


def test_a_file_written_starts_its_writeback_as_it_goes_and_the_tail_is_the_fsyncs(
    tmp_path, tracker, monkeypatch
):
    """Every byte but the last partial chunk has its writeback started, in order, once each."""
    started: list[tuple[int, int]] = []
    monkeypatch.setattr(_progress_io, "start_writeback", lambda _fd, at, n: started.append((at, n)))
    size = 3 * WRITEBACK_CHUNK + 12345
    fs = ProgressFileSystem(tmp_path, tracker)
    with fs.create_stream(tmp_path / "shard", "wb") as f:
        for at in range(0, size, 1 << 20):
            f.write(b"x" * min(1 << 20, size - at))
    assert started and started[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(started))
    assert all(n >= WRITEBACK_CHUNK for _, n in started)
    assert 0 <= size - sum(n for _, n in started) < WRITEBACK_CHUNK


def test_writeback_is_left_to_the_fsync_where_it_does_not_apply_and_other_errors_are_raised(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 8192)
        f.flush()
        start_writeback(f.fileno(), 0, 8192)  # a file on a disk: started, nothing to say
    r, w = os.pipe()
    try:
        start_writeback(w, 0, 1)  # ESPIPE: not a file it applies to
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(OSError) as e:
        start_writeback(w, 0, 1)  # closed: EBADF
    assert e.value.errno == errno.EBADF


def test_staging_copies_start_only_once_the_save_call_releases_them():
    """Started at once, the copies took the GIL from the rest of the save call; they wait for its
    end (``release``), so what the state holds then is what they copy."""
    stager = OrderedStager(CPU_STAGING)
    try:
        state = {"w": torch.arange(4.0)}
        staged = stager.stage(state)
        state["w"].add_(1)  # before the release: not copied yet
        assert not staged.done()
        stager.release()
        assert torch.equal(staged.result()["w"], torch.arange(4.0) + 1)
    finally:
        stager.close()


def test_writes_are_sized_to_the_rate_they_run_at_within_bounds():
    """Few large writes on a fast disk (each write(2) costs), small ones on a slow file system
    (each must end well within a phase timeout, so the save beats)."""
    assert next_write_chunk(MIN_WRITE_CHUNK, 1e-6) == MAX_WRITE_CHUNK  # page cache: ~16 GB/s
    assert next_write_chunk(MIN_WRITE_CHUNK, 0.0) == MAX_WRITE_CHUNK  # below the clock's resolution
    assert next_write_chunk(MIN_WRITE_CHUNK, 16 / 45) == MIN_WRITE_CHUNK  # 45 kB/s
    mid = next_write_chunk(1 << 20, 0.1)  # 10 MB/s: what WRITE_CHUNK_S takes at that rate
    assert mid % 4096 == 0 and (1 << 20) * WRITE_CHUNK_S / 0.1 - 4096 < mid <= (1 << 20) * WRITE_CHUNK_S / 0.1


def test_a_keepalive_beats_between_files_only(tracker):
    """A rank waiting on its peers inside DCP's save or load (between its files) beats, as a wait
    (no progress, until its exchange gives up); one inside a file operation (a read, a write, a
    rename) does not, so a stuck one still goes silent naming the file."""
    k = Keepalive(tracker, bound_s=30.0)
    k.beat()
    k.set_path("step_00000010.tmp.x/__1_0.distcp")
    k(4096)
    k.beat()  # inside the write: no beat
    before = time.time()
    k.set_path("")
    k.beat()
    assert tracker.units == [4096]
    assert [w for w, _ in tracker.waits] == [PEERS_IN_DCP, PEERS_IN_DCP]
    assert before + 30.0 <= tracker.waits[-1][1] <= time.time() + 30.0, "30 s after its last file"


# ---------------------------------------------------------------- a wait on background work


class _Beats:
    """The waiting thread's tracker: each call is a heartbeat, recorded as (bytes done, file)."""

    def __init__(self) -> None:
        self.total = self.done = 0
        self.path = ""
        self.beats: list[tuple[int, str]] = []

    def __call__(self, n: int) -> None:
        self.done += n
        self.beats.append((self.done, self.path))

    def set_path(self, path: str) -> None:
        self.path = path

    def wait(self, what: str, until: float = 0.0) -> None:
        self.beats.append((self.done, f"waiting for {what}"))


class _Watched(Relay):
    """A Relay that counts the waiter's looks at it (each look reads ``moves``), so the test
    waits for looks, not for time."""

    def __init__(self) -> None:
        self.looks = 0
        self._looked = threading.Condition()
        super().__init__()

    @property  # type: ignore[override]
    def moves(self) -> int:
        if threading.current_thread().name == "waiter":
            with self._looked:
                self.looks += 1
                self._looked.notify_all()
        return self._moves

    @moves.setter
    def moves(self, value: int) -> None:
        self._moves = value

    def looked(self, more: int) -> None:
        """Return once the waiter looked ``more`` more times from now."""
        with self._looked:
            want = self.looks + more
            assert self._looked.wait_for(lambda: self.looks >= want, timeout=PATIENCE_S)


def test_a_wait_on_background_work_beats_when_it_moved_and_never_while_it_is_stuck():
    """How the loop waits on an async save's background commit: a slow commit is no hang, a
    stuck one goes silent naming its file (the watchdog's hang verdict)."""
    work, beats, done = _Watched(), _Beats(), Future[None]()
    args = (done, work, beats, 0.001)
    waiter = threading.Thread(target=wait_forwarding, args=args, name="waiter", daemon=True)
    waiter.start()
    try:
        work.set_path("step_00000010.tmp.x/__1_0.distcp")
        work(1000)
        work.looked(2)  # a whole look after the move
        assert beats.beats[-1] == (1000, "step_00000010.tmp.x/__1_0.distcp")
        silent = len(beats.beats)
        work.looked(50)  # stuck: 50 looks, nothing moved
        assert len(beats.beats) == silent
        work.set_path("")  # its part done: waiting for the peers
        work.looked(2)
        assert beats.beats[silent:] == [(1000, "")]
        work.wait("peers")  # agree.beating's keepalive while it waits: forwarded as a wait
        work.looked(2)
        assert beats.beats[silent:] == [(1000, ""), (1000, ""), (1000, "waiting for peers")]
        work(24)  # a byte again: progress, the wait over
        work.looked(2)
        assert beats.beats[-1] == (1024, "") and work.waiting == ("", 0.0)
    finally:
        done.set_result(None)
    waiter.join(PATIENCE_S)
    assert not waiter.is_alive()


# ---------------------------------------------------------------- the bounds of a save's waits


def test_a_saves_waits_are_bounded_at_half_the_watchdogs_save_and_commit_timeouts(caplog):
    """The watchdog passes its phase timeouts to each launch; a rank bounds its save's collectives
    and backoffs at half the shorter of save and commit (issue 44: ranks in different collectives
    waited forever). Without a watchdog, or with a value it cannot read, the defaults'."""
    env = {ENV_PHASE_TIMEOUTS: json.dumps({"save": 30.0, "commit": 8, "train": 1})}
    assert phase_timeouts(env) == {Phase.SAVE: 30.0, Phase.COMMIT: 8.0}
    assert wait_bound_s(Phase.SAVE, Phase.COMMIT, environ=env) == 4.0
    assert wait_bound_s(Phase.SAVE, environ=env) == 15.0
    assert wait_bound_s(Phase.SAVE, Phase.COMMIT, environ={}) == 0.5 * min(
        DEFAULT_SAVE_TIMEOUT_S, DEFAULT_COMMIT_TIMEOUT_S
    )
    for bad in ("{", "[1]", json.dumps({"save": -1}), json.dumps({"commit": True})):
        assert phase_timeouts({ENV_PHASE_TIMEOUTS: bad}) == phase_timeouts({})
    assert "unreadable" in caplog.text and ENV_PHASE_TIMEOUTS in caplog.text
