"""The GPU paths' decisions, on CPU: which device a rank takes, whose CUDA generator a resume
restores, and which replicated tensors a ddp rank saves.

No GPU here: where a test needs CUDA, it fakes only the CUDA calls (``torch.cuda.is_available``,
``current_device``, ``get_device_properties``, ``get_rng_state``, ``set_rng_state``) with
``monkeypatch``; everything else (the per-rank file, torch.load with weights_only, the decisions)
is the real code. ``make gpu-check`` runs the same paths on a real GPU.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from supervisor.resumable import _devices
from supervisor.resumable._devices import CudaDevice, DeviceError, cuda_rng_to_restore, device_index
from supervisor.resumable._train_state import RankState, replica_share, seed_rank_rng
from train_ref.config import get_config
from train_ref.ema import EMA
from train_ref.model import GPT

# ------------------------------------------------------------ the device of a rank


@pytest.mark.parametrize(
    ("local_rank", "local_world", "visible", "want"),
    [
        (0, 1, 1, 0),  # one process, one GPU
        (3, 8, 8, 3),  # torchrun on a node, every GPU visible to every process
        (1, 2, 8, 1),  # more visible than ranks: LOCAL_RANK still picks
        (5, 8, 1, 0),  # SLURM's binding: each process sees only its own GPU
    ],
)
def test_device_is_local_rank_when_each_rank_has_one_else_the_only_visible_one(
    local_rank, local_world, visible, want
):
    assert device_index(local_rank, local_world, visible, "0,1") == want


def test_fewer_devices_than_ranks_is_refused_on_every_rank_alike():
    """4 ranks, 2 visible: ranks 0 and 1 could run, 2 and 3 would share a GPU with them. Every
    rank refuses (the same counts on the whole node), not only those without a device."""
    lines = set()
    for local in range(4):
        with pytest.raises(DeviceError) as e:
            device_index(local, 4, 2, "2,3")
        lines.add(str(e.value))
    (line,) = lines
    assert "\n" not in line and "CUDA_VISIBLE_DEVICES=2,3" in line and "bind exactly one" in line


# ------------------------------------------------------------ whose CUDA generator


GPU_A = CudaDevice(index=1, uuid="GPU-aaaa", visible="0,1")
GPU_A_ALONE = CudaDevice(index=0, uuid="GPU-aaaa", visible="1")  # the same GPU, bound alone
GPU_B = CudaDevice(index=0, uuid="GPU-bbbb", visible="0,1")
STATE = torch.arange(16, dtype=torch.uint8)


def record(dev: CudaDevice) -> dict:
    return _devices.cuda_rng_record(STATE, dev)


@pytest.mark.parametrize("now", [GPU_A, GPU_A_ALONE, GPU_B])
def test_the_saved_stream_goes_onto_the_device_the_rank_uses_now(now):
    """Another index, another CUDA_VISIBLE_DEVICES, fewer visible devices, another GPU: the rank's
    own stream is restored onto its device; a move is said in one line, no move says nothing."""
    state, note = cuda_rng_to_restore(record(GPU_A), now, "rank_00001.state.pt")
    assert torch.equal(state, STATE)
    if now == GPU_A:
        assert note == ""
    else:
        assert "\n" not in note and "rank_00001.state.pt" in note
        assert GPU_A.describe() in note and now.describe() in note


def test_without_cuda_on_one_side_nothing_is_restored_and_it_is_said():
    assert cuda_rng_to_restore(None, None, "f") == (None, "")
    state, note = cuda_rng_to_restore(None, GPU_B, "rank_00000.state.pt")
    assert state is None and "saved without CUDA" in note and "keeps this launch's seed" in note
    state, note = cuda_rng_to_restore(record(GPU_A), None, "rank_00000.state.pt")
    assert state is None and "no CUDA device now" in note and "GPU-aaaa" in note


def test_the_earlier_all_devices_format_is_a_one_line_refusal():
    stacked = torch.stack([STATE, STATE + 1])  # every visible device by index: whose is unknown
    with pytest.raises(DeviceError) as e:
        cuda_rng_to_restore(stacked, GPU_B, "/ck/step_00000010/rank_00003.state.pt")
    line = str(e.value)
    assert "\n" not in line and "rank_00003.state.pt" in line and "resume from a checkpoint" in line


class FakeCuda:
    """Stands in for CUDA's calls only: one generator state per device index of the process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, dev: CudaDevice):
        self.states: dict[int, torch.Tensor] = {}
        self.dev = dev
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.dev.index)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=self.dev.uuid)
        )
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i: self.states[i].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: self.states.__setitem__(i, s.clone()))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", dev.visible)

    def move_to(self, monkeypatch: pytest.MonkeyPatch, dev: CudaDevice) -> None:
        self.dev = dev
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", dev.visible)


def test_rank_state_file_round_trip_moves_the_stream_to_the_new_device(monkeypatch, tmp_path, caplog):
    """Saved while the rank ran on cuda:1 of two visible; resumed bound alone to the same GPU
    (cuda:0 of one visible): the earlier code restored by index and crashed (one device now)."""
    cuda = FakeCuda(monkeypatch, GPU_A)
    cuda.states = {0: torch.full((16,), 7, dtype=torch.uint8), 1: STATE.clone()}
    path = tmp_path / "rank_00001.state.pt"
    RankState.save(path)
    cuda.move_to(monkeypatch, GPU_A_ALONE)
    cuda.states = {0: torch.zeros(16, dtype=torch.uint8)}
    with caplog.at_level("WARNING"):
        RankState.load(path)
    assert torch.equal(cuda.states[0], STATE)  # its own stream, not device 0's at save time
    assert list(cuda.states) == [0]
    assert any("restored onto cuda:0 (GPU-aaaa, CUDA_VISIBLE_DEVICES=1)" in r.message for r in caplog.records)


def test_cpu_streams_are_restored_alongside_the_cuda_one(monkeypatch, tmp_path):
    cuda = FakeCuda(monkeypatch, GPU_B)
    cuda.states = {0: STATE.clone()}
    seed_rank_rng(1, 0, 0)
    path = tmp_path / "rank.pt"
    RankState.save(path)
    want = (random.random(), torch.rand(1).item())
    seed_rank_rng(2, 0, 0)
    cuda.states = {0: torch.zeros(16, dtype=torch.uint8)}
    RankState.load(path)
    assert (random.random(), torch.rand(1).item()) == want and torch.equal(cuda.states[0], STATE)


# ------------------------------------------------------------ ddp: each replicated tensor staged once


def trained_state() -> dict:
    """A TrainState-shaped dict of the tiny model with AdamW moments (one step taken)."""
    torch.manual_seed(0)
    model = GPT(get_config("tiny", vocab_size=67).model)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 67, (2, 8)), torch.randint(0, 67, (2, 8))).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    ema = EMA(model, 0.9).state_dict()
    return {"model": model_sd, "optim": optim_sd, "scheduler": {"last_epoch": 1}, "step": 1, "ema": ema}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_replicated_tensors_are_split_between_ranks_once_each(world):
    sd = trained_state()
    shares = [replica_share(sd, r, world) for r in range(world)]
    keys = [set(s["model"]) for s in shares]
    assert set().union(*keys) == set(sd["model"])  # every parameter saved...
    assert sum(len(k) for k in keys) == len(sd["model"])  # ...by exactly one rank
    ema = [set(s["ema"]) for s in shares]  # the moving averages: each by one rank too
    assert set().union(*ema) == set(sd["ema"]) and sum(len(k) for k in ema) == len(sd["ema"])
    for s, k in zip(shares, keys, strict=True):
        assert set(s["optim"]["state"]) == k  # a parameter's moments go with it
        assert s["optim"]["param_groups"] == sd["optim"]["param_groups"]  # small: DCP keeps one
        assert s["scheduler"] == sd["scheduler"] and s["step"] == 1
    staged = [sum(t.numel() * t.element_size() for t in s["model"].values()) for s in shares]
    total = sum(t.numel() * t.element_size() for t in sd["model"].values())
    biggest = max(t.numel() * t.element_size() for t in sd["model"].values())
    # Each stages about 1/world of the model (split_by_size: within one parameter of it), not all.
    assert max(staged) < total / world + biggest + 256
