"""The hold gate (train_ref/hold.py): the file protocol, a held rank that beats and is released,
and the trainer's agreement, in two real gloo processes where only one rank saw the file."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import pytest
from waiting import PATIENCE_S, processes, wait_for, wait_held

from train_ref import hold
from train_ref.hold import HoldFileError, HoldGate, read_hold


def test_the_file_says_a_step_or_nothing(tmp_path: Path) -> None:
    gate = tmp_path / "hold"
    assert read_hold(gate) is None
    hold.hold_at(gate, 12)
    assert read_hold(gate) == 12 and HoldGate(gate, 0).wanted(12) and not HoldGate(gate, 0).wanted(11)
    gate.write_text("soon\n")
    with pytest.raises(HoldFileError, match=r"hold says 'soon': write a step number") as e:
        read_hold(gate)
    assert str(gate) in str(e.value) and "\n" not in str(e.value)


def test_off_unless_the_variable_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hold.ENV_HOLD_FILE, raising=False)
    assert HoldGate.from_env(0) is None
    monkeypatch.setenv(hold.ENV_HOLD_FILE, str(tmp_path / "hold"))
    gate = HoldGate.from_env(3, "launch-1")
    assert gate is not None and (gate.path, gate.rank, gate.launch) == (tmp_path / "hold", 3, "launch-1")


@pytest.mark.parametrize("how", ["release", "move on"])
def test_a_held_rank_acks_beats_and_goes_on_when_released(tmp_path: Path, how: str) -> None:
    gate = tmp_path / "hold"
    hold.hold_at(gate, 5)
    beats = []
    t = threading.Thread(target=HoldGate(gate, 1, "L").hold, args=(5, lambda: beats.append(1)))
    t.start()
    try:
        assert hold.held(gate, 2, 5) is None  # rank 0 never held
        ack = wait_for(lambda: hold.acks(gate, 2).get(1), "rank 1's ack")
        assert (ack["step"], ack["launch"]) == (5, "L")
        wait_for(lambda: len(beats) >= 3, "beats while held")
        assert t.is_alive()
    finally:
        hold.release(gate) if how == "release" else hold.hold_at(gate, 9)
        t.join(PATIENCE_S)
    assert not t.is_alive()


def test_a_notice_that_arrives_while_held_is_acknowledged(tmp_path: Path) -> None:
    """A test releases held ranks once they have the notice (e.g. SLURM's SIGTERM, sent to every
    process of the step): they act on it at the very next step boundary."""
    gate = tmp_path / "hold"
    hold.hold_at(gate, 5)
    notice = threading.Event()
    threads = [
        threading.Thread(target=HoldGate(gate, r, "L").hold, args=(5, lambda: None, notice.is_set))
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: hold.held(gate, 2, 5), "both ranks held")
        assert hold.noticed(gate, 2, 5) is None
        notice.set()
        acks = wait_for(lambda: hold.noticed(gate, 2, 5), "both acks to carry the notice")
        assert all(a["notice"] and a["step"] == 5 for a in acks.values())
    finally:
        hold.release(gate)
        for t in threads:
            t.join(PATIENCE_S)
    assert not any(t.is_alive() for t in threads)


def _rank(rank: int, store: str, gate: str, out: mp.Queue) -> None:
    import torch.distributed as dist

    from train_ref.train import hold_if_asked

    class Stale(HoldGate):
        def wanted(self, step: int) -> bool:
            return False  # read the file just before it was written

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    g = (HoldGate if rank == 1 else Stale)(Path(gate), rank)
    held = hold_if_asked(g, 4, lambda: None, lambda: False)
    dist.barrier()
    out.put((rank, held))
    dist.destroy_process_group()


def test_the_trainer_agrees_every_rank_holds_when_one_saw_the_file(tmp_path: Path) -> None:
    gate = tmp_path / "hold"
    hold.hold_at(gate, 4)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with processes(ctx, [(_rank, (r, str(tmp_path / "store"), str(gate), out)) for r in (0, 1)]) as procs:
        acks = wait_held(gate, 2, 4)
        assert {r: a["pid"] for r, a in acks.items()} == {r: p.pid for r, p in enumerate(procs)}
        hold.release(gate)
        results = dict(out.get(timeout=PATIENCE_S) for _ in procs)
    assert results == {0: True, 1: True}
    assert [p.exitcode for p in procs] == [0, 0]
