"""Two runs' checkpoints of the same steps, compared item by item (the drill's "why the digest differs").

    python -m supervisor.resumable._compare --pair STEP GOLDEN_CKPT RUN_CKPT [--pair ...]

prints one ``supervisor.format.statediff.Comparison`` as JSON: the pairs in step order, up to the
first whose checkpoints differ, each with the items that differ (the shared state's: model,
optimizer, scheduler, sampler, step, the trainer's own; each rank's RNG streams and per-rank
items) and the first entry inside each. The drill (torch-free) runs it with the trainer's python
and judges what it prints (supervisor/drill/diverge.py).

Everything is read through the safe reader (supervisor/resumable/_safe_load.py): nothing a
checkpoint holds is run. A checkpoint is loaded whole, into this process, without a model: the
drill's runs are small.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from supervisor.format.layout import RANK_PREFIX
from supervisor.format.statediff import SHARED, Comparison, ItemDiff, StepDiff
from supervisor.resumable._safe_load import (
    CorruptRecord,
    SafeFileSystemReader,
    SafeLoadPlanner,
    every_index,
    one_line,
)
from supervisor.resumable._train_state import _item_of
from supervisor.safepickle import UnsafePickle

_RANK_FILE_SUFFIX = ".state.pt"  # layout.rank_state_filename's


class _Everything(_EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the whole state from the index (no model needed), its
    non-tensor items unpickled with ``weights_only=True`` as every load here does."""

    def __init__(self, reader: SafeFileSystemReader):
        super().__init__()
        self.reader = reader

    load_bytes = SafeLoadPlanner.load_bytes


def load_shared(ckpt: Path) -> dict[str, Any]:
    """The shared state of ``ckpt``, item by item (``model``, ``optim``, ``scheduler``...)."""
    reader = SafeFileSystemReader(ckpt)
    if not reader.choose_index():  # one index per rank (sharded state): every rank's, merged
        reader = SafeFileSystemReader(ckpt, index=every_index(ckpt, reader.fs, None))
        reader.choose_index()
    sd: dict[str, Any] = {}
    with warnings.catch_warnings():  # no_dist's "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message="torch.distributed is")
        _load_state_dict(sd, storage_reader=reader, planner=_Everything(reader), no_dist=True)
    shared = sd.get(SHARED)
    return shared if isinstance(shared, dict) else {}


def load_rank_files(ckpt: Path) -> dict[int, dict[str, Any]]:
    """Each rank's own file of ``ckpt`` (its RNG streams and per-rank items), by rank."""
    out = {}
    for path in sorted(ckpt.glob(f"{RANK_PREFIX}*{_RANK_FILE_SUFFIX}")):
        digits = path.name[len(RANK_PREFIX) : -len(_RANK_FILE_SUFFIX)]
        if digits.isdigit():
            sd = torch.load(path, weights_only=True)
            out[int(digits)] = sd if isinstance(sd, dict) else {}
    return out


def leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf) of a nested state: dicts by sorted key, lists and tuples by index."""
    if isinstance(value, Mapping):
        for k in sorted(value, key=str):
            yield from leaves(value[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, value


def how_differ(a: Any, b: Any) -> str:
    """'' when ``a`` and ``b`` are the same to the bit, else how they differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} vs {b.dtype}"
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        return "" if torch.equal(_bytes(a), _bytes(b)) else "values differ"
    if type(a) is not type(b):
        return f"{type(a).__name__} vs {type(b).__name__}"
    same = a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
    return "" if same else f"{_short(a)} vs {_short(b)}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that NaNs and -0.0 compare as stored."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _learned(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def item_diff(item: str, rank: int | None, golden: Any, run: Any) -> ItemDiff | None:
    """The first entry of one item that differs between golden's and the run's, or None."""
    ours = dict(leaves(run))
    for key, want in leaves(golden):
        if key not in ours:
            return ItemDiff(item, rank, key, "only in golden", _learned(want))
        how = how_differ(want, ours.pop(key))
        if how:
            return ItemDiff(item, rank, key, how, _learned(want))
    if ours:
        key, got = next(iter(ours.items()))
        return ItemDiff(item, rank, key, "only in the resumed run", _learned(got))
    return None


def compare(golden: Path, run: Path) -> tuple[ItemDiff, ...]:
    """The items of ``run`` that differ from ``golden``: the shared ones, then each rank's."""
    diffs: list[ItemDiff | None] = []
    g, r = load_shared(golden), load_shared(run)
    for key in sorted(set(g) | set(r)):
        diffs.append(item_diff(_item_of(key), None, g.get(key), r.get(key)))
    g_ranks, r_ranks = load_rank_files(golden), load_rank_files(run)
    for rank in sorted(set(g_ranks) | set(r_ranks)):
        gs, rs = g_ranks.get(rank, {}), r_ranks.get(rank, {})
        for key in sorted(set(gs) | set(rs)):
            diffs.append(item_diff(key, rank, gs.get(key), rs.get(key)))
    return tuple(d for d in diffs if d is not None)


def compare_steps(pairs: list[tuple[int, Path, Path]]) -> Comparison:
    """Each pair in step order, up to the first that differs; one that cannot be read is a problem
    (named, one line) and the walk goes on."""
    steps: list[StepDiff] = []
    problems: list[str] = []
    for step, golden, run in sorted(pairs):
        try:
            differs = compare(golden, run)
        except (OSError, UnsafePickle, CorruptRecord, RuntimeError, ValueError) as e:
            problems.append(f"step {step}: {golden} vs {run}: {one_line(e)}")
            continue
        steps.append(StepDiff(step, differs))
        if differs:
            break
    return Comparison(tuple(steps), tuple(problems))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supervisor.resumable._compare", description=__doc__)
    p.add_argument(
        "--pair",
        nargs=3,
        action="append",
        default=[],
        metavar=("STEP", "GOLDEN", "RUN"),
        help="a step both runs saved, and its checkpoint in each",
    )
    args = p.parse_args(argv)
    pairs = [(int(s), Path(g), Path(r)) for s, g, r in args.pair]
    print(compare_steps(pairs).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
