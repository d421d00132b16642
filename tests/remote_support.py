"""Shared pieces of the remote-tier tests: a real S3-compatible server on loopback (moto in server
mode, stoppable and restartable on the same port with its objects kept, like an endpoint that goes
down for a while), small fake checkpoints made through supervisor.store, and the two tiers."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import pytest
from commands import free_port

from supervisor import store
from supervisor.format.manifest import CheckpointInfo
from supervisor.tiers.remote import RemoteTier, open_remote

# The tier kinds every remote test runs against: a directory, and S3 (moto on loopback).
KINDS = ("dir", "s3")
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer:
    """moto's S3 over HTTP on 127.0.0.1; its objects live in this process, so stop() then start()
    on the same port is an endpoint outage, not data loss."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._cls = ThreadedMotoServer
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._srv = None

    def start(self) -> None:
        self._srv = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._srv.start()

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.stop()
            self._srv = None


def new_bucket(server: MotoServer) -> str:
    """A fresh bucket on the server, so tests sharing the server never see each other's objects."""
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    tier = open_remote(f"s3://{name}", endpoint=server.endpoint)
    tier.backend.fs.mkdir(name)
    return f"s3://{name}/run"


def make_tier(kind: str, tmp_path: Path, server: MotoServer | None) -> RemoteTier:
    if kind == "dir":
        return open_remote(str(tmp_path / "shared" / "run"))
    assert server is not None
    return open_remote(new_bucket(server), endpoint=server.endpoint)


def fake_checkpoint(root: Path, step: int, *, files: int = 3, size: int = 64 << 10) -> store.CheckpointRef:
    """A committed checkpoint of random bytes, made with the store's own commit protocol."""
    tmp = store.begin(root, step)
    for i in range(files):
        (tmp / f"__{i}_0.distcp").write_bytes(os.urandom(size))
    (tmp / "ranks").mkdir()
    (tmp / "ranks" / "rank_00000.pt").write_bytes(step.to_bytes(8, "little"))
    info = CheckpointInfo(step, files, model_config_hash="cfg", data_fingerprint="data")
    return store.commit(root, tmp, info)


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Every file under a checkpoint directory, for byte-for-byte comparisons."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def payload(path: Path) -> dict[str, bytes]:
    """The checkpoint's data files (the manifest aside: a local re-commit rewrites its wall time)."""
    return {k: v for k, v in tree_bytes(path).items() if k != "manifest.json"}


def serve_moto():
    """Generator behind each test module's ``moto`` fixture: fake credentials, a running server.
    Skips (visibly, with -rs) where the ``dev`` extra's moto[server] and s3fs are not installed."""
    pytest.importorskip("moto.server", reason="moto[server] not installed: pip install -e '.[dev]'")
    pytest.importorskip("s3fs", reason="s3fs not installed: pip install -e '.[dev]'")
    saved = {k: os.environ.get(k) for k in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
