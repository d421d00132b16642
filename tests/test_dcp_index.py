"""DCP's index, one for all ranks or one per rank (supervisor/resumable/_dcp_index.py): which a save writes, the
per-rank ones merged, and a load that reads what every tensor needs or says why not.

Two-rank FSDP checkpoints with an index per rank are loaded in test_train_parallel.py (each rank
reads its own) and test_train_world_size.py (another world size or layout: all of them, merged)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from supervisor import safepickle
from supervisor.format.layout import dcp_index_filename, is_dcp_index
from supervisor.resumable._dcp_index import merged, per_rank_index, tensor_bytes, uncovered
from supervisor.resumable._safe_load import CorruptRecord, load_dcp
from supervisor.resumable._shard_writer import shard_writer


def test_names_of_the_indexes() -> None:
    assert dcp_index_filename() == ".metadata" and dcp_index_filename(12) == "__12_index.metadata"
    assert is_dcp_index(".metadata") and is_dcp_index("__3_index.metadata")
    assert not is_dcp_index("__3_0.distcp") and not is_dcp_index("x.metadata")
    assert not is_dcp_index("__3.metadata")  # DCP's own name for it, which torch's load reads unchecked


def test_an_index_per_rank_only_for_sharded_state_with_little_replicated() -> None:
    assert not per_rank_index(replicated=4 << 20, sharded=0, world_size=2)  # DDP: nothing sharded
    assert per_rank_index(replicated=800, sharded=600 << 20, world_size=4096)  # FSDP's step counters
    # every rank writes its own copy of what is replicated: 4096 copies of 1 MiB vs a 1 GiB checkpoint
    assert not per_rank_index(replicated=1 << 20, sharded=1 << 30, world_size=4096)
    assert per_rank_index(replicated=1 << 20, sharded=1 << 30, world_size=8)


def test_plain_tensors_count_as_replicated_wherever_they_sit() -> None:
    sd = {"model": {"w": torch.zeros(4, 4)}, "optim": {"state": {0: {"m": torch.zeros(8, dtype=torch.float64)}}},
          "groups": [{"lr": 0.1}], "step": torch.tensor(3)}  # fmt: skip
    assert tensor_bytes(sd) == (16 * 4 + 8 * 8 + 8, 0)


def _tensor(size: tuple[int, ...], *chunks: tuple[tuple[int, ...], tuple[int, ...]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def _rank_index(rank: int, rows: int) -> Metadata:
    """What rank ``rank`` of 2 writes for a (4, 3) tensor split by rows and a step both hold."""
    off = (rank * rows, 0)
    return Metadata(
        {"w": _tensor((4, 3), (off, (rows, 3))), "step": BytesStorageMetadata()},
        storage_data={
            MetadataIndex("w", off, 0): _StorageInfo(f"__{rank}_0.distcp", 0, 100),
            MetadataIndex("step"): _StorageInfo(f"__{rank}_0.distcp", 100, 10),
        },
    )


def test_merged_holds_every_ranks_chunks_and_one_copy_of_what_all_wrote() -> None:
    md = merged([_rank_index(0, 2), _rank_index(1, 2)])
    w = md.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata)
    assert [tuple(c.offsets) for c in w.chunks] == [(0, 0), (2, 0)]
    assert md.storage_data[MetadataIndex("w", (2, 0))].relative_path == "__1_0.distcp"
    assert md.storage_data[MetadataIndex("step")].relative_path == "__0_0.distcp"  # the lowest rank's
    assert len(md.storage_data) == 3


def test_merged_refuses_ranks_that_disagree() -> None:
    other = _rank_index(1, 2)
    other.state_dict_metadata["w"] = _tensor((5, 3), ((2, 0), (2, 3)))
    with pytest.raises(ValueError, match=r"w: \(5, 3\) torch.float32 in one index, \(4, 3\)"):
        merged([_rank_index(0, 2), other])
    other.state_dict_metadata["w"] = _tensor((4, 3), ((0, 0), (3, 3)))
    with pytest.raises(ValueError, match=r"a chunk at \(0, 0\) of \(3, 3\) in one index"):
        merged([_rank_index(0, 2), other])


def test_uncovered_names_the_first_tensor_a_plan_reads_only_in_part() -> None:
    sd = {"w": torch.zeros(4, 3), "step": 0}
    full = merged([_rank_index(0, 2), _rank_index(1, 2)])
    assert uncovered(create_default_local_load_plan(sd, full), sd) is None
    half = _rank_index(0, 2)  # rank 0's own index: rows 0-1 only
    assert uncovered(create_default_local_load_plan(sd, half), sd) == "w: 6 of 12 elements"


def _save(path: Path, state: dict[str, object], per_rank: bool) -> None:
    """Saved by the trainer's writer (an index per rank under this toolkit's name for it)."""
    with warnings.catch_warnings():  # no_dist's "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(
            state, storage_writer=shard_writer(path, path.parent), no_dist=True, use_collectives=not per_rank
        )


def test_a_checkpoint_with_an_index_per_rank_loads_without_a_process_group(tmp_path: Path) -> None:
    ckpt = tmp_path / "alone"
    _save(ckpt, {"w": torch.arange(12.0).view(4, 3), "step": 7}, per_rank=True)
    assert sorted(p.name for p in ckpt.iterdir() if is_dcp_index(p.name)) == [dcp_index_filename(0)]
    out = {"w": torch.zeros(4, 3), "step": 0}
    load_dcp(ckpt, out, None)
    assert torch.equal(out["w"], torch.arange(12.0).view(4, 3)) and out["step"] == 7


def test_an_index_that_leaves_part_of_a_tensor_unread_is_corrupt(tmp_path: Path) -> None:
    """DCP would read the covered rows and leave the rest as it was: a silently wrong load."""
    ckpt = tmp_path / "short"
    _save(ckpt, {"w": torch.arange(12.0).view(4, 3)}, per_rank=False)
    md = pickle.loads((ckpt / dcp_index_filename()).read_bytes())
    md.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((2, 3)))
    (ckpt / dcp_index_filename()).write_bytes(pickle.dumps(md))
    out = {"w": torch.full((4, 3), -1.0)}
    with pytest.raises(CorruptRecord) as e:
        load_dcp(ckpt, out, None)
    line = str(e.value)
    assert (
        line.startswith(f"{ckpt / dcp_index_filename()}: reads only w: 6 of 12 elements") and "\n" not in line
    )
    assert "ckpt verify --deep" in line
    assert torch.equal(out["w"], torch.full((4, 3), -1.0))  # nothing applied


def test_per_rank_indexes_with_a_rank_missing_are_corrupt(tmp_path: Path) -> None:
    ckpt = tmp_path / "gap"
    _save(ckpt, {"w": torch.arange(4.0)}, per_rank=True)
    (ckpt / dcp_index_filename(0)).rename(ckpt / dcp_index_filename(1))
    with pytest.raises(
        CorruptRecord, match=r"gap: no \.metadata and no __0_index\.metadata: the checkpoint is"
    ):
        load_dcp(ckpt, {"w": torch.zeros(4)}, None)


def test_a_tampered_per_rank_index_is_refused_before_it_runs(tmp_path: Path) -> None:
    ckpt = tmp_path / "tampered"
    _save(ckpt, {"w": torch.arange(4.0)}, per_rank=True)
    (ckpt / dcp_index_filename(0)).write_bytes(b"cposix\nsystem\n(S'touch /nonexistent/x'\ntR.")
    with pytest.raises(safepickle.UnsafePickle) as e:
        load_dcp(ckpt, {"w": torch.zeros(4)}, None)
    assert str(e.value).startswith(f"{ckpt / dcp_index_filename(0)}: refers to posix.system")


def test_torchs_own_load_finds_no_index_where_each_rank_has_its_own(tmp_path: Path) -> None:
    """Under DCP's own per-rank name, torch's ``dcp.load`` (and this toolkit's versions before
    these indexes) would read one rank's index unchecked: on another layout, part of a tensor.
    Under ours it finds none and fails loudly."""
    ckpt = tmp_path / "ours"
    _save(ckpt, {"w": torch.arange(4.0)}, per_rank=True)
    with warnings.catch_warnings(), pytest.raises(CheckpointException, match="metadata is None"):
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=ckpt, no_dist=True)
