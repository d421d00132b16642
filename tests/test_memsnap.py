"""The memory tier's format, torch-free (supervisor/format/memsnap.py): the tree codec keeps every
type the state holds, an index is checked field by field before anything trusts it, a node's
complete snapshots are told from partial ones, the checksum catches a flipped byte and a truncation,
and the interval follows the overhead budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from memsnap_helpers import index, written

from supervisor.format import memsnap


class T:
    """A stand-in for a tensor: the codec only asks the caller which values are tensors."""


def _refs(table: list[object]):
    def ref(x: object) -> int | None:
        if not isinstance(x, T):
            return None
        table.append(x)
        return len(table) - 1

    return ref


def test_the_codec_keeps_types_key_types_and_order_and_refers_to_tensors() -> None:
    a, b = T(), T()
    state = {
        "step": 7,
        "lr": 0.1,
        "nan": math.inf,
        "betas": (0.9, 0.95),
        "names": ["w", "b"],
        3: {"exp_avg": a, "step": b},
        "raw": b"\x00\xff",
        "none": None,
        "flag": True,
        "big": 2**70,
    }
    table: list[object] = []
    tree = memsnap.encode(state, _refs(table))
    assert table == [a, b]
    back = memsnap.decode(json.loads(json.dumps(tree)), lambda ref, path: (ref, path))
    assert back[3] == {"exp_avg": (0, (3, "exp_avg")), "step": (1, (3, "step"))}
    assert list(back) == list(state) and back["betas"] == (0.9, 0.95) and isinstance(back["betas"], tuple)
    assert {k: v for k, v in back.items() if k != 3} == {k: v for k, v in state.items() if k != 3}
    assert dict(memsnap.paths(tree)) == {(3, "exp_avg"): 0, (3, "step"): 1}


def test_a_value_it_cannot_hold_is_named_where_it_is() -> None:
    with pytest.raises(memsnap.Unsupported, match=r"\.optim\.extra: a set"):
        memsnap.encode({"optim": {"extra": {1, 2}}}, lambda x: None)


@pytest.mark.parametrize(
    "tree",
    [
        {"__tensor__": "0"},
        {"__dict__": [[1]]},
        {"a": 1, "b": 2},
        {"__bytes__": "not base64!"},
        {"__dict__": [[{"__tensor__": 0}, 1]]},
    ],
)
def test_decode_refuses_a_tree_encode_never_makes(tree: object) -> None:
    with pytest.raises((memsnap.SnapshotError, ValueError)):
        memsnap.decode(tree, lambda ref, path: ref)


def test_layout_aligns_each_tensor_and_an_index_round_trips() -> None:
    ix = index()
    assert [t.offset % memsnap.ALIGN for t in ix.tensors] == [0, 0, 0]
    assert [t.nbytes for t in ix.tensors] == [24, 10, 8] and ix.size == 136
    assert memsnap.parse_index(json.dumps(ix.to_dict()).encode(), "x") == ix


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda d: d["tensors"].append(["float32", [4], 128, 16]), "beyond"),
        (lambda d: d["tensors"].append(["float32", [4], 0, 15]), "wrong size"),
        (lambda d: d["tensors"].append(["object", [1], 0, 8]), "not \\[dtype"),
        (lambda d: d.update(step=-1), "step"),
        (lambda d: d.update(checksum_algo="md5"), "checksum_algo"),
        (lambda d: d.pop("launch"), "launch"),
        (lambda d: d.update(format=99), "format"),
    ],
)
def test_a_bad_index_is_refused_naming_what(change, why) -> None:
    d = index().to_dict()
    change(d)
    with pytest.raises(memsnap.SnapshotError, match=why):
        memsnap.parse_index(json.dumps(d).encode(), "idx")


def test_complete_wants_every_local_rank_at_one_step_in_one_slot(tmp_path: Path) -> None:
    two = [(0, index(5, 0, 0, 2)), (0, index(5, 1, 1, 2)), (1, index(4, 0, 0, 2)), (0, index(6, 1, 1, 2))]
    done = memsnap.complete(tmp_path, two)
    assert [(s.step, s.slot, sorted(s.ranks)) for s in done] == [(5, 0, [0, 1])]
    split = [(0, index(5, 0, 0, 2)), (1, index(5, 1, 1, 2))]  # one rank's in the other slot
    assert memsnap.complete(tmp_path, split) == []


@pytest.mark.parametrize("mapped", [False, True], ids=["read (the watchdog)", "mapped (the rank)"])
def test_verify_catches_a_flipped_byte_and_a_short_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool
) -> None:
    """Read in chunks smaller than a tensor (into one reused buffer) or hashed from a mapping,
    the checksum is the one over each tensor's bytes whole."""
    monkeypatch.setattr(memsnap, "READ_CHUNK", 7)
    ix = written(tmp_path, index())
    ((slot, read),), problems = memsnap.read_slots(tmp_path)
    assert (slot, read, problems) == (0, ix, [])
    assert memsnap.verify_rank(tmp_path, 0, ix, mapped=mapped) == ""
    path = memsnap.data_path(tmp_path, 0, 0)
    raw = bytearray(path.read_bytes())
    raw[ix.tensors[1].offset + ix.tensors[1].nbytes - 1] ^= 1
    path.write_bytes(bytes(raw))
    assert "checksum" in memsnap.verify_rank(tmp_path, 0, ix, mapped=mapped)
    path.write_bytes(bytes(raw[:-1]))
    assert "135 bytes, its index says 136" in memsnap.verify_rank(tmp_path, 0, ix, mapped=mapped)


def test_records_are_checked_and_a_pick_never_names_a_folder_outside(tmp_path: Path) -> None:
    memsnap.write_record(tmp_path / memsnap.PICK, memsnap.Pick(3, 40, 1, "replica/2").to_dict())
    assert memsnap.read_pick(tmp_path) == memsnap.Pick(3, 40, 1, "replica/2")
    pick = memsnap.Pick(3, 40, 1, "", older=((30, 0),))
    memsnap.write_record(tmp_path / memsnap.PICK, pick.to_dict())
    assert memsnap.read_pick(tmp_path) == pick
    assert (pick.steps(), pick.at(30), pick.at(40)) == ((40, 30), memsnap.Pick(3, 30, 0, ""), pick)
    # an older one that is not older, in the pick's own slot, or more than the other slot holds
    for older in ([[40, 0]], [[30, 1]], [[30, 0], [20, 0]], [[30, 2]], [["30", 0]], "30"):
        memsnap.write_record(tmp_path / memsnap.PICK, {**pick.to_dict(), "older": older})
        assert memsnap.read_pick(tmp_path) is None, older
    for folder in ("../x", "replica/../../x", "/etc"):
        memsnap.write_record(
            tmp_path / memsnap.PICK, {**memsnap.Pick(3, 40, 1, "").to_dict(), "folder": folder}
        )
        assert memsnap.read_pick(tmp_path) is None
    (tmp_path / memsnap.COMMITTED).write_text('{"format": 1, "step": 3, "slot": 2, "launch": "x"}')
    assert memsnap.read_commit(tmp_path) is None


@pytest.mark.parametrize(
    ("copy_s", "step_s", "every", "plan"),
    [
        (0.001, 0.1, 0, (True, 1)),  # 1% of a step: on the loop, every step
        (0.009, 0.1, 0, (False, 3)),  # 9%: off the loop, every 3 steps (3% each)
        (0.5, 1.0, 0, (False, 17)),
        (0.5, 1.0, 4, (False, 4)),  # asked for: every 4 whatever it costs
        (0.001, 0.1, 2, (True, 2)),
    ],
)
def test_the_interval_keeps_the_copy_within_the_budget(copy_s, step_s, every, plan) -> None:
    assert memsnap.plan(copy_s, step_s, every) == plan


@pytest.mark.parametrize(
    ("offers", "agreed"),
    [
        ([(12, 8), (12, 8)], 12),
        ([(12, 8), (8,)], 8),  # a node one push behind: every node goes back to the step before
        (
            [(12,), (12, 8), (8, 4)],
            "no step that every node holds a snapshot of (rank 0: 12; rank 1: 12, 8; rank 2: 8, 4)",
        ),
        ([(), ()], "no memory snapshot picked for this launch"),
        ([(12, 8), ()], "rank 1: no memory snapshot picked for this launch"),
        (
            [(9,), (8,), (7,), (6,), (5,), (5,)],
            "no step that every node holds a snapshot of (rank 0: 9; rank 1: 8; rank 2: 7; rank 3: 6; and 1 more)",
        ),
    ],
)
def test_the_ranks_agree_on_the_newest_step_every_node_holds(offers, agreed) -> None:
    from supervisor.resumable._memory import common_step

    assert common_step(offers) == agreed


def test_a_pinned_slot_makes_the_rank_busy_until_the_pin_goes(tmp_path: Path) -> None:
    """The watchdog pins the slot it pushes to the buddy: the rank whose next snapshot would
    overwrite it says busy in the step's control all-reduce (every rank then skips), and not for
    the other slot, nor once the pin is gone (each change seen, whatever the stat cache holds)."""
    from supervisor.resumable._memory import MemoryTier

    tier = MemoryTier(tmp_path, rank=0, world_size=1, every=1)
    nxt = (tier.first_slot + tier.snapshots) % memsnap.SLOTS
    assert tier.flags()[0] == 0
    memsnap.write_record(tmp_path / memsnap.PINNED, memsnap.Pinned(nxt, 4).to_dict())
    assert tier.flags()[0] == 1
    memsnap.write_record(tmp_path / memsnap.PINNED, memsnap.Pinned(1 - nxt, 5).to_dict())
    assert tier.flags()[0] == 0
    (tmp_path / memsnap.PINNED).unlink()
    assert tier.flags()[0] == 0
