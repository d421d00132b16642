"""What a signing key costs: the commit and the deep verify with a key next to the same without,
measured side by side in one run (bench/verify.py's approach and checkpoint).

    .venv/bin/python bench/signing.py [--size-gib 1] [--files 8] [--dir DIR] [--rounds 3]

Writes one checkpoint of ``--files`` shards through the real commit protocol, then times, on the
same files, interleaved in every round (best of ``--rounds``):

- commit: ``store.commit`` of a copy of the shards without a key, and with one (the key adds a
  SHA-256 of every file and ``manifest.sig``; the checksums are computed in both);
- deep verify: ``store.validate(deep=True)`` without a key (xxh3-128) and with one (xxh3-128 and
  SHA-256 from one read, plus the HMAC), page cache hot, and cold where the pages can be dropped;
- the candidate digests alone in memory (SHA-256, BLAKE2b keyed and not), to show why SHA-256.

Prints GB/s and the ratios keyed / unkeyed. No target: signing is opt-in, this says its price.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.verify import GB, MEM_HASH_BYTES, drop_cache, raw_read, shard_paths, side_by_side, write_checkpoint
from supervisor import store
from supervisor.format.manifest import READ_CHUNK, VERIFY_THREADS, CheckpointInfo

KEY = os.urandom(32)


def deep(ref: store.CheckpointRef, key: bytes | None) -> int:
    v = store.validate(ref, deep=True, key=key)
    if not v.ok:
        raise SystemExit(f"bench checkpoint failed verification: {v.reason}")
    return v.manifest.total_bytes  # type: ignore[union-attr]


def committer(root: Path, src: list[Path], key: bytes | None) -> tuple:
    """A function that commits a fresh copy of the shards (the copy untimed, as ``before``)."""
    step = [1000 if key is None else 2000]
    pending: list[Path] = []

    def prepare() -> None:
        step[0] += 1
        tmp = store.begin(root, step[0])
        for p in src:
            os.link(p, tmp / p.name)  # the same bytes, hot in the page cache, no copy
        pending.append(tmp)

    def commit() -> int:
        tmp = pending.pop()
        ref = store.commit(root, tmp, CheckpointInfo(step[0], len(src)), sign_key=key)
        n = sum(p.stat().st_size for p in src)
        shutil.rmtree(ref.path)
        return n

    return prepare, commit


def in_memory(rounds: int) -> dict[str, float]:
    data = os.urandom(MEM_HASH_BYTES)
    view = memoryview(data)
    makers = {
        "sha256 (chosen)": hashlib.sha256,
        "blake2b": hashlib.blake2b,
        "blake2b keyed": lambda: hashlib.blake2b(key=KEY, digest_size=32),
    }
    out = {}
    for name, make in makers.items():

        def run(make=make) -> int:
            h = make()
            for i in range(0, len(view), READ_CHUNK):
                h.update(view[i : i + READ_CHUNK])
            return len(view)

        out[name] = side_by_side([run], rounds, lambda: None)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where to write it (default: a temp dir; use the real disk)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    size = int(args.size_gib * (1 << 30))
    work = Path(tempfile.mkdtemp(prefix="bench-signing-", dir=args.dir))
    try:
        plain = write_checkpoint(work / "plain", size, args.files)
        signed = write_checkpoint(work / "signed", size, args.files)
        # Signed afterwards through the same protocol: re-commit its shards with the key.
        tmp = store.begin(work / "signed", 2)
        for p in shard_paths(signed):
            os.link(p, tmp / p.name)
        signed = store.commit(work / "signed", tmp, CheckpointInfo(2, args.files), sign_key=KEY)
        paths = shard_paths(plain) + shard_paths(signed)
        print(f"checkpoint: {args.files} shards, {size / GB:.2f} GB; {VERIFY_THREADS} hashing threads")
        mem = in_memory(args.rounds)
        print("digest alone, in memory (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items()))

        raw_read(paths)
        rows = [
            (
                "hot (page cache)",
                *side_by_side(
                    [lambda: deep(plain, None), lambda: deep(signed, KEY)], args.rounds, lambda: None
                ),
            )
        ]
        if drop_cache(paths):
            rows.append(
                ("cold (fadvise DONTNEED)", *side_by_side([lambda: deep(plain, None), lambda: deep(signed, KEY)], args.rounds, lambda: drop_cache(paths)))
            )  # fmt: skip
        src = shard_paths(plain)
        commits = []
        for key in (None, KEY):
            prepare, commit = committer(work / "commits", src, key)
            commits.append((prepare, commit))
        best = [0.0, 0.0]
        for _ in range(args.rounds):  # interleaved, each commit of a fresh hard-linked copy
            for i, (prepare, commit) in enumerate(commits):
                prepare()
                t = time.perf_counter()
                n = commit()
                best[i] = max(best[i], n / (time.perf_counter() - t) / GB)
        print(f"{'GB/s':38} {'no key':>8} {'key':>8} {'key/no key':>11}")
        for label, a, b in rows:
            print(f"{'deep verify, ' + label:38} {a:8.2f} {b:8.2f} {b / a:11.2f}")
        print(f"{'commit (hot)':38} {best[0]:8.2f} {best[1]:8.2f} {best[1] / best[0]:11.2f}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
