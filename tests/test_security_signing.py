"""Signed checkpoints (supervisor/signing.py): the key and its file, commit, validation, pick,
``ckpt verify``, and the remote tier (a real directory remote): with a key, an unsigned or wrongly
signed checkpoint is skipped with its reason, never loaded, never quarantined, never a silent
fresh start; without one, everything is as before. No torch (the trainer's side:
tests/test_security_e2e.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd
from security_helpers import KEY, OTHER_KEY, tamper
from store_helpers import SHARD, default_files, latest_text, make_ckpt, quarantine_dirs

from supervisor import signing, store
from supervisor.cli.main import main
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import MANIFEST, SIGNATURE, RunDir, step_dirname
from supervisor.signing import SigningKeyError, load_key
from supervisor.tiers.remote import RemoteUntrusted, open_remote
from supervisor.tiers.resume import prepare_resume

ENV = "RT_TEST_SIGNING_KEY"


def ref(root: Path, step: int) -> store.CheckpointRef:
    return store.CheckpointRef(step, root / step_dirname(step))


def forge_signature(ckpt: Path, key: bytes, wrong_digest_for: str) -> None:
    """A signature made WITH the key over the real manifest, but with one file's digest wrong: what
    an xxh3 collision would look like (the bytes pass the manifest, not their signed SHA-256)."""
    m = store.validate(store.CheckpointRef(int(ckpt.name[5:]), ckpt)).manifest
    assert m is not None
    digests = signing.digest_files(ckpt, m.files)
    digests[wrong_digest_for] = "0" * 64
    (ckpt / SIGNATURE).write_bytes(signing.sign((ckpt / MANIFEST).read_bytes(), digests, key))


# ---------------------------------------------------------------- the key


def key_file(tmp_path: Path, mode: int = 0o600, data: bytes = KEY) -> Path:
    p = tmp_path / "keys" / "run.key"
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(data + b"\n")
    p.chmod(mode)
    return p


def test_key_from_a_0600_file_or_the_environment(tmp_path: Path, monkeypatch) -> None:
    assert load_key(str(key_file(tmp_path))) == KEY  # the trailing newline stripped
    monkeypatch.setenv(ENV, KEY.decode())
    assert load_key(f"env:{ENV}") == KEY


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (lambda t: str(key_file(t, 0o644)), "has mode 0644, readable or writable by others; chmod 600"),
        (lambda t: str(key_file(t, 0o640)), "has mode 0640"),
        (lambda t: str(key_file(t, 0o600, b"short")), "is 5 bytes, fewer than 32"),
        (lambda t: str(t / "missing.key"), "no such signing key file"),
        (lambda t: str(t / "keys"), "not a regular file"),
        (lambda t: "env:RT_TEST_UNSET_VARIABLE", "environment variable RT_TEST_UNSET_VARIABLE is not set"),
    ],
)  # fmt: skip
def test_an_unusable_key_is_one_line_naming_it(tmp_path: Path, setup, says: str) -> None:
    (tmp_path / "keys").mkdir()
    source = setup(tmp_path)
    with pytest.raises(SigningKeyError) as e:
        load_key(source)
    msg = str(e.value)
    assert says in msg and "\n" not in msg
    assert source.removeprefix("env:") in msg


def test_a_key_file_inside_the_run_dir_or_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    inside = root / "run.key"
    inside.write_bytes(KEY)
    inside.chmod(0o600)
    with pytest.raises(SigningKeyError, match=r"inside .*run.*could replace it"):
        load_key(str(inside), outside=(root,))
    link = tmp_path / "link.key"  # a symlink outside pointing inside is inside
    link.symlink_to(inside)
    with pytest.raises(SigningKeyError, match="inside"):
        load_key(str(link), outside=(None, f"file://{root}"))
    if os.geteuid() == 0:  # root can hand the file to someone else
        other = key_file(tmp_path)
        os.chown(other, 65534, 65534)
        with pytest.raises(SigningKeyError, match="belongs to uid 65534, not to you"):
            load_key(str(other))


# ---------------------------------------------------------------- commit and validation


def test_a_signed_commit_verifies_with_its_key_only(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10, sign_key=KEY)
    ckpt = tmp_path / "step_00000010"
    sig = json.loads((ckpt / SIGNATURE).read_text())
    assert sig["mac"] == "hmac-sha256" and sig["digest"] == "sha256"
    assert set(sig["files"]) == set(default_files(10)) and sig["key_id"] == signing.key_id(KEY)
    for deep in (False, True):
        assert store.validate(ref(tmp_path, 10), deep=deep, key=KEY).signature == "ok"
        assert store.validate(ref(tmp_path, 10), deep=deep).ok  # without a key: as before
        v = store.validate(ref(tmp_path, 10), deep=deep, key=OTHER_KEY)
        assert v.evidence is store.Evidence.UNTRUSTED and v.signature == "bad signature"
        assert "signed with another key" in v.reason and v.reason.startswith("step_00000010: ")


def test_unsigned_and_tampered_checkpoints_are_untrusted(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    v = store.validate(ref(tmp_path, 10), key=KEY)
    assert (v.evidence, v.signature) == (store.Evidence.UNTRUSTED, "unsigned")
    assert "no manifest.sig" in v.reason

    make_ckpt(tmp_path, 20, sign_key=KEY)
    tamper(tmp_path / "step_00000020", SHARD, b"other weights")  # the manifest made to agree
    assert store.validate(ref(tmp_path, 20), deep=True).ok  # the store alone cannot tell
    v = store.validate(ref(tmp_path, 20), key=KEY)
    assert v.signature == "bad signature" and "manifest.json was changed after it was signed" in v.reason

    make_ckpt(tmp_path, 30, sign_key=KEY)
    forge_signature(tmp_path / "step_00000030", KEY, SHARD)
    assert store.validate(ref(tmp_path, 30), key=KEY).ok  # quick: the signature verifies
    v = store.validate(ref(tmp_path, 30), deep=True, key=KEY)
    assert v.signature == "bad signature" and f"{SHARD}'s sha256 differs from the signed one" in v.reason

    make_ckpt(tmp_path, 40, sign_key=KEY)
    sig = json.loads((tmp_path / "step_00000040" / SIGNATURE).read_text())
    sig["files"][SHARD] = "0" * 64  # edited without the key
    (tmp_path / "step_00000040" / SIGNATURE).write_text(json.dumps(sig))
    v = store.validate(ref(tmp_path, 40), key=KEY)
    assert "HMAC does not verify" in v.reason

    make_ckpt(tmp_path, 50, sign_key=KEY)
    corrupt(tmp_path / "step_00000050", Corruption.TRUNCATE)  # corruption stays corruption, key or not
    assert store.validate(ref(tmp_path, 50), key=KEY).evidence is store.Evidence.CORRUPT


def test_pick_skips_untrusted_checkpoints_and_never_quarantines_them(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10, sign_key=KEY)
    make_ckpt(tmp_path, 20, sign_key=KEY)
    make_ckpt(tmp_path, 30)  # unsigned (e.g. planted, or from before the key was set)
    make_ckpt(tmp_path, 40, sign_key=OTHER_KEY)
    make_ckpt(tmp_path, 50, sign_key=KEY)
    corrupt(tmp_path / "step_00000050", Corruption.TRUNCATE)
    for deep in (False, True):
        res = store.pick(tmp_path, deep=deep, key=KEY, dry_run=True)
        assert res.chosen is not None and res.chosen.ref.name == "step_00000020"
    res = store.pick(tmp_path, deep=True, key=KEY)
    assert res.chosen is not None and res.chosen.ref.name == "step_00000020"
    assert [n for n, _ in res.untrusted] == ["step_00000040", "step_00000030"]
    assert "unsigned" in dict(res.untrusted)["step_00000030"]
    assert [n for n, _ in res.quarantined] == ["step_00000050"]  # only the corrupt one moved
    assert (tmp_path / "step_00000030").is_dir() and (tmp_path / "step_00000040").is_dir()
    assert latest_text(tmp_path) == "step_00000020\n"
    # Without the key the run is as before: the newest whole checkpoint.
    assert store.pick(tmp_path).chosen.ref.name == "step_00000040"  # type: ignore[union-attr]


def test_nothing_trusted_is_never_a_silent_fresh_start(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20, sign_key=OTHER_KEY)
    with pytest.raises(store.NoUsableCheckpoint) as e:
        store.pick(tmp_path, key=KEY)
    msg = str(e.value)
    assert "no trusted checkpoint: 2 checkpoints are not signed with this run's key" in msg
    assert "newest step_00000020: bad signature: signed with another key" in msg
    assert "--signing-key" in msg and "--allow-fresh-start" in msg and "\n" not in msg
    assert quarantine_dirs(tmp_path) == []
    assert store.pick(tmp_path, key=KEY, allow_fresh_start=True).chosen is None


# ---------------------------------------------------------------- ckpt verify / pick


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ckpt_verify_says_which(tmp_path: Path, capsys, monkeypatch) -> None:
    root = tmp_path / "run"
    make_ckpt(root, 10, sign_key=KEY)
    make_ckpt(root, 20)
    make_ckpt(root, 30, sign_key=OTHER_KEY)
    monkeypatch.setenv(ENV, KEY.decode())
    rc, out, _ = run_cli(
        capsys, "ckpt", "verify", "--deep", "--ckpt-root", str(root), "--signing-key", f"env:{ENV}"
    )
    assert rc == Exit.FOUND_PROBLEM
    assert (
        "UNTRUSTED  unsigned: no manifest.sig" in out
        and "UNTRUSTED  bad signature: signed with another key" in out
    )
    assert "1 of 3 checkpoints valid" in out and "signatures" in out
    rc, out, _ = run_cli(
        capsys, "ckpt", "verify", "--json", "--ckpt-root", str(root), "--signing-key", f"env:{ENV}"
    )
    rows = {r["step"]: r for r in json.loads(out)["checkpoints"]}
    assert {s: r["signature"] for s, r in rows.items()} == {10: "ok", 20: "unsigned", 30: "bad signature"}
    assert rows[20]["evidence"] == "untrusted" and not rows[20]["ok"]
    rc, out, _ = run_cli(capsys, "ckpt", "verify", "--json", "--ckpt-root", str(root))  # no key: as before
    assert rc == Exit.OK and all("signature" not in r for r in json.loads(out)["checkpoints"])
    rc, out, _ = run_cli(capsys, "ckpt", "pick", "--ckpt-root", str(root), "--signing-key", f"env:{ENV}")
    assert rc == Exit.OK and "picked step_00000010" in out
    assert "skipped step_00000030 (not trusted): bad signature" in out and quarantine_dirs(root) == []


def test_a_loose_key_file_is_exit_2_everywhere(tmp_path: Path, capsys) -> None:
    root = tmp_path / "run"
    make_ckpt(root, 10)
    loose = key_file(tmp_path, 0o644)
    rc, out, err = run_cli(capsys, "ckpt", "verify", "--ckpt-root", str(root), "--signing-key", str(loose))
    assert rc == Exit.USAGE and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {loose}: the signing key file has mode 0644")
    p = subprocess.run(
        supervisor_cmd("watch", "--ckpt-root", str(root), "--signing-key", str(loose),
                       "--", sys.executable, "-c", "raise SystemExit(3)"),
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == Exit.USAGE and p.stderr.strip().endswith(f"chmod 600 {loose}"), p.stderr
    assert p.stderr.count("\n") == 1 and not (RunDir.of(root).supervisor / "events.jsonl").exists()


# ---------------------------------------------------------------- the remote tier


def upload_all(local: Path, remote: Path) -> None:
    tier = open_remote(str(remote))  # the uploader's tier has no key: it carries signatures along
    for r in store.list_checkpoints(local):
        tier.upload(r)


def test_remote_resume_downloads_only_what_this_key_signed(tmp_path: Path) -> None:
    local, remote = tmp_path / "node" / "run", tmp_path / "shared"
    make_ckpt(local, 10, sign_key=KEY)
    make_ckpt(local, 20, sign_key=KEY)
    make_ckpt(local, 30)  # unsigned
    upload_all(local, remote)
    assert (remote / "step_00000010" / SIGNATURE).is_file() and not (
        remote / "step_00000030" / SIGNATURE
    ).exists()
    shutil.rmtree(local.parent)  # node loss

    events: list[tuple[str, str]] = []
    res = prepare_resume(
        local, open_remote(str(remote), key=KEY), key=KEY, on_event=lambda e, m: events.append((e.NAME, m))
    )
    assert res.source == "remote" and res.chosen is not None and res.chosen.name == "step_00000020"
    assert [n for n, _ in res.untrusted] == [f"{remote}/step_00000030"]
    assert any(e == "untrusted" and "unsigned" in m for e, m in events)
    assert res.remote_quarantined == () and (remote / "step_00000030").is_dir()  # never quarantined
    # The local copy is signed again with the key (its manifest is a new one) and verifies deep.
    assert store.validate(ref(local, 20), deep=True, key=KEY).signature == "ok"


def test_remote_with_nothing_trusted_refuses_and_moves_nothing(tmp_path: Path) -> None:
    local, remote = tmp_path / "node" / "run", tmp_path / "shared"
    make_ckpt(local, 10)
    make_ckpt(local, 20, sign_key=OTHER_KEY)
    upload_all(local, remote)
    shutil.rmtree(local.parent)
    with pytest.raises(store.NoUsableCheckpoint, match="no trusted checkpoint: 2 checkpoints"):
        prepare_resume(local, open_remote(str(remote), key=KEY), key=KEY)
    assert sorted(os.listdir(remote)) == [".lock", "step_00000010", "step_00000020"]
    assert store.list_checkpoints(local) == []
    # Without a key the same remote is used as before (the signature is only carried along).
    res = prepare_resume(local, open_remote(str(remote)))
    assert res.chosen is not None and res.chosen.name == "step_00000020"
    assert not (local / "step_00000020" / SIGNATURE).exists()


def test_remote_bytes_that_differ_from_their_signed_digest_are_not_committed(tmp_path: Path) -> None:
    local, remote = tmp_path / "node" / "run", tmp_path / "shared"
    make_ckpt(local, 10, sign_key=KEY)
    make_ckpt(local, 20, sign_key=KEY)
    upload_all(local, remote)
    shutil.rmtree(local.parent)
    forge_signature(remote / "step_00000020", KEY, SHARD)  # passes the quick check, not the digests
    tier = open_remote(str(remote), key=KEY)
    with pytest.raises(RemoteUntrusted, match=f"step_00000020/{SHARD}: bad signature: its sha256 differs"):
        tier.download(20, local)
    assert store.list_checkpoints(local) == [] and [p for p in local.iterdir() if ".tmp." in p.name] == []
    res = prepare_resume(local, tier, key=KEY)
    assert res.chosen is not None and res.chosen.name == "step_00000010" and res.source == "remote"
    assert [n for n, _ in res.untrusted] == [f"{remote}/step_00000020"]
