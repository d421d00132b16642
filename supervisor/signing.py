"""Optional authenticity of checkpoints: a run's key signs each manifest and the bytes it lists.

The manifest's xxh3-128 checksums catch corruption, not an adversary (xxh3 is not collision
resistant: whoever can write a checkpoint can craft bytes with the listed checksum), so a signature
over the manifest alone would not bind the files. With a key, each commit also records a SHA-256
digest of every file (SHA-256: with the CPU's SHA extensions about 2.5x faster than BLAKE2b here,
bench/signing.py) and writes ``manifest.sig`` (``SIGNATURE``) beside the manifest:

    {"digest": "sha256", "files": {"<name>": "<sha256 hex>", ...}, "format": 1,
     "hmac": "<HMAC-SHA256(key, the other fields as compact sorted JSON)>",
     "key_id": "<first 16 hex of HMAC-SHA256(key, 'resumable-training key id')>",
     "mac": "hmac-sha256", "manifest_sha256": "<sha256 of manifest.json's exact bytes>"}

A checkpoint is trusted under a key when its signature file parses, was made with that key (key
id), its HMAC verifies, it signs exactly these manifest bytes and exactly the files the manifest
lists (the quick check: one small read and one HMAC), and, deep, every file's SHA-256 is the
signed one. Otherwise it is UNSIGNED (no ``manifest.sig``) or has a BAD SIGNATURE: never loaded,
never quarantined (a checkpoint from before the key was set is not corrupt), skipped by a resume.

The key never enters the run directory: an environment variable (``env:NAME``) or a file only its
owner can read, outside the run directory (``load_key``). Threat model: docs/security.md.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import stat
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor.errors import UserError
from supervisor.format import confined
from supervisor.format.layout import SIGNATURE
from supervisor.format.manifest import hash_files

SIG_FORMAT = 1
MAC_ALGO = "hmac-sha256"
DIGEST_ALGO = "sha256"
MIN_KEY_BYTES = 32
ENV_PREFIX = "env:"
_KEY_ID_MSG = b"resumable-training key id"
GENERATE = "python -c 'import secrets; print(secrets.token_hex(32))'"

# Verdict words (``ckpt verify`` prints them).
OK = "ok"
UNSIGNED = "unsigned"
BAD = "bad signature"


class SigningKeyError(UserError, ValueError):
    """The key cannot be used (missing, too short, readable by others, inside the run directory);
    ``str(e)`` is one line naming the file or variable and the fix."""


class Untrusted(ValueError):
    """Not signed with this key; ``kind`` is UNSIGNED or BAD, ``str(e)`` is one line."""

    def __init__(self, kind: str, why: str):
        super().__init__(f"{kind}: {why}")
        self.kind = kind


@dataclass(frozen=True)
class Signature:
    key_id: str
    manifest_sha256: str
    files: Mapping[str, str]  # name -> SHA-256 hex


def key_id(key: bytes) -> str:
    """A fingerprint that names a key in messages without revealing anything usable about it."""
    return hmac.new(key, _KEY_ID_MSG, hashlib.sha256).hexdigest()[:16]


def _mac(key: bytes, body: Mapping[str, object]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def sign(manifest_bytes: bytes, digests: Mapping[str, str], key: bytes) -> bytes:
    """The content of ``manifest.sig`` for these exact manifest bytes and file digests."""
    body = {
        "format": SIG_FORMAT,
        "mac": MAC_ALGO,
        "digest": DIGEST_ALGO,
        "key_id": key_id(key),
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
        "files": dict(sorted(digests.items())),
    }
    return (json.dumps({**body, "hmac": _mac(key, body)}, indent=1, sort_keys=True) + "\n").encode()


def verify(manifest_bytes: bytes, sig_bytes: bytes | None, names: Collection[str], key: bytes) -> Signature:
    """The quick check: the signature is this key's, over these manifest bytes and exactly the
    files ``names`` (the manifest's list). Raises Untrusted saying why not."""
    if sig_bytes is None:
        raise Untrusted(UNSIGNED, f"no {SIGNATURE} (this run requires checkpoints signed with its key)")
    try:
        d = json.loads(sig_bytes)
    except (ValueError, RecursionError):
        raise Untrusted(BAD, f"{SIGNATURE} is not valid JSON") from None
    if not isinstance(d, dict) or not isinstance(d.get("hmac"), str) or not isinstance(d.get("files"), dict):
        raise Untrusted(BAD, f"{SIGNATURE} is not a signature")
    if (d.get("format"), d.get("mac"), d.get("digest")) != (SIG_FORMAT, MAC_ALGO, DIGEST_ALGO):
        raise Untrusted(BAD, f"{SIGNATURE} is of an unknown format or algorithm")
    mine = key_id(key)
    if d.get("key_id") != mine:
        raise Untrusted(BAD, f"signed with another key (key id {d.get('key_id')}; this key is {mine})")
    given = d.pop("hmac")
    if not _same(given, _mac(key, d)):
        raise Untrusted(BAD, f"{SIGNATURE}'s HMAC does not verify: it was altered, or made without this key")
    if d.get("manifest_sha256") != hashlib.sha256(manifest_bytes).hexdigest():
        raise Untrusted(BAD, "manifest.json was changed after it was signed")
    files = {str(k): str(v) for k, v in d["files"].items()}
    other = sorted(set(files) ^ set(names))
    if other:
        raise Untrusted(BAD, f"{SIGNATURE} signs other files than the manifest lists ({other[0]})")
    return Signature(mine, d["manifest_sha256"], files)


def _same(given: str, expected: str) -> bool:
    """``hmac.compare_digest`` of two strings as UTF-8: it refuses a ``str`` with non-ASCII
    characters (TypeError), which a signature file can hold."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


def check_digests(sig: Signature, actual: Mapping[str, str]) -> None:
    """The deep check: every file's SHA-256 is the signed one. Raises Untrusted naming the file."""
    for name, digest in sorted(actual.items()):
        if not _same(sig.files.get(name, ""), digest):
            raise Untrusted(
                BAD, f"{name}'s {DIGEST_ALGO} differs from the signed one: its bytes were replaced"
            )


def digest_files(ckpt_dir: Path, names: Iterable[str]) -> dict[str, str]:
    """SHA-256 of each file, hashed in parallel (hashlib releases the GIL)."""
    names = sorted(names)
    sums = hash_files([ckpt_dir / n for n in names], (DIGEST_ALGO,))
    return {n: s[0] for n, s in zip(names, sums, strict=True)}


def write_signature(
    root: Path,
    ckpt_dir: Path,
    manifest_bytes: bytes,
    names: Collection[str],
    key: bytes,
    known: Mapping[str, str] | None = None,
) -> None:
    """Sign a checkpoint being committed in the run directory ``root``: digests of ``names``
    (``known`` ones reused: a download computed them while verifying), then ``manifest.sig``,
    fsynced, written through no link (confined.py). The caller fsyncs the directory."""
    known = {n: d for n, d in (known or {}).items() if n in names}
    digests = {**known, **digest_files(ckpt_dir, set(names) - set(known))}
    confined.write_new(root, ckpt_dir / SIGNATURE, sign(manifest_bytes, digests, key))


# ---------------------------------------------------------------- the key


def add_signing_key_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--signing-key``: one flag, the same for the trainer, the watchdog and ``ckpt``."""
    p.add_argument(
        "--signing-key",
        default=None,
        metavar="env:NAME|FILE",
        help="sign checkpoints with this key / accept only checkpoints signed with it: an environment "
        "variable, or a file only you can read (0600) outside the run directory (docs/security.md)",
    )


def load_key(source: str, *, outside: Iterable[str | Path | None] = ()) -> bytes:
    """The key named by ``source``: ``env:NAME`` (an environment variable) or the path of a file
    that only its owner can read (mode 0600 or stricter), owned by this user, and not inside any of
    ``outside`` (the run directory, a directory remote): whoever can write there could replace it.
    At least MIN_KEY_BYTES bytes, surrounding whitespace stripped. SigningKeyError otherwise."""
    if source.startswith(ENV_PREFIX):
        var = source[len(ENV_PREFIX) :]
        key = os.environ.get(var, "").strip().encode()
        if not key:
            raise SigningKeyError(
                f"--signing-key {source}: environment variable {var} is not set or empty; "
                f"set it to a secret of at least {MIN_KEY_BYTES} characters, e.g. $({GENERATE})"
            )
        what = f"environment variable {var}"
    else:
        path = Path(source).expanduser()
        key = _read_key_file(path, outside)
        what = str(path)
    if len(key) < MIN_KEY_BYTES:
        raise SigningKeyError(
            f"{what}: the signing key is {len(key)} bytes, fewer than {MIN_KEY_BYTES}; "
            f"make a new one with {GENERATE}"
        )
    return key


def _read_key_file(path: Path, outside: Iterable[str | Path | None]) -> bytes:
    real = Path(os.path.realpath(path))
    for d in outside:
        d = None if d is None else str(d).removeprefix("file://")
        if d is not None and "://" not in d and real.is_relative_to(os.path.realpath(d)):
            raise SigningKeyError(
                f"{path}: the signing key file is inside {d}, where whoever can write the run's "
                "files could replace it; keep it outside (e.g. ~/.config), chmod 600"
            )
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SigningKeyError(
            f"{path}: no such signing key file; create one: (umask 077; {GENERATE} > {path})"
        ) from None
    except OSError as e:
        raise SigningKeyError(f"{path}: cannot read the signing key file ({e.strerror})") from None
    st = os.fstat(fd)  # of what was opened: no window for a swap after the check
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SigningKeyError(f"{path}: the signing key is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_uid != os.geteuid():
            raise SigningKeyError(
                f"{path}: the signing key file belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
                "use a key file of your own"
            )
        if st.st_mode & 0o077:
            raise SigningKeyError(
                f"{path}: the signing key file has mode {stat.S_IMODE(st.st_mode):04o}, readable or "
                f"writable by others; chmod 600 {path}"
            )
        return f.read().strip()
