"""Optimizer state allocated for a load (supervisor/resumable/_optim_state.py): the same state torch's own
initialisation for a load makes (one step over zero gradients), without the step, and a load into
it ends bit-identical to a load into torch's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import _init_optim_state

from supervisor.resumable._objects import Objects
from supervisor.resumable._optim_state import prime_for_load
from supervisor.resumable._safe_load import load_dcp
from supervisor.resumable._shard_writer import shard_writer

Make = Callable[[list[dict[str, object]]], torch.optim.Optimizer]
ADAMS: dict[str, Make] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True),
    "adamw-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
    "adam-for-loop": lambda groups: torch.optim.Adam(groups, lr=1e-2, foreach=False),
}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    m[0].bias.requires_grad_(False)  # frozen: torch gives it no gradient, so no state
    return m


def groups(m: torch.nn.Module) -> list[dict[str, object]]:
    """Two groups with their own settings, as trainers split decay and no-decay parameters."""
    return [{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": 1e-3}]


@pytest.mark.parametrize("name", ADAMS)
def test_the_state_is_torchs_own_without_the_step(name: str) -> None:
    m = model()
    by_torch, primed = ADAMS[name](groups(m)), ADAMS[name](groups(m))
    _init_optim_state(by_torch)
    assert prime_for_load(primed)
    assert len(primed.state) == len(by_torch.state) == 3  # every parameter but the frozen bias
    for p, want in by_torch.state.items():
        got = primed.state[p]
        assert got.keys() == want.keys(), name
        for k, v in want.items():
            assert (got[k].dtype, got[k].shape, got[k].device) == (v.dtype, v.shape, v.device), (name, k)
            assert got[k].is_contiguous() == v.is_contiguous()
            assert not got[k].any()  # zeros; torch's step is 1 there, about to be overwritten
    assert all(p.grad is None for p in m.parameters())  # no gradient allocated, none left behind
    assert [g["lr"] for g in primed.param_groups] == [1e-2, 1e-3]


def test_anything_else_is_left_to_torch() -> None:
    """Another optimizer, a subclass, one with state or with a gradient already (torch then
    makes no state): False, nothing made."""

    class MyAdam(torch.optim.Adam):
        pass

    m = model()
    assert not prime_for_load(None)
    for other in (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), MyAdam(m.parameters())):
        assert not prime_for_load(other) and not other.state
    stepped = torch.optim.AdamW(m.parameters())
    m(torch.ones(2, 6)).sum().backward()
    assert not prime_for_load(stepped) and not stepped.state  # a gradient is there
    stepped.step()
    before = {p: dict(s) for p, s in stepped.state.items()}
    assert not prime_for_load(stepped)
    assert all(stepped.state[p][k] is v for p, s in before.items() for k, v in s.items())


@pytest.mark.parametrize("name", ["adamw", "adam-amsgrad"])
def test_a_load_into_primed_state_is_bit_identical(tmp_path: Path, name: str) -> None:
    """Saved after three steps; loaded into a fresh model and optimizer, once primed and once
    torch's way; then both take the same two steps: every parameter and state tensor equal."""
    m = model()
    opt = ADAMS[name](groups(m))
    for i in range(3):
        m(torch.full((4, 6), float(i))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ckpt = tmp_path / "step_00000003"
    dcp.save({"app": Objects({"model": m, "optimizer": opt})}, storage_writer=shard_writer(ckpt, tmp_path))

    def resumed(prime: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        fresh = model()
        fresh_opt = ADAMS[name](groups(fresh))
        if prime:
            assert prime_for_load(fresh_opt)
        load_dcp(ckpt, {"app": Objects({"model": fresh, "optimizer": fresh_opt})}, None)
        for i in range(2):
            fresh(torch.full((4, 6), 10.0 + i)).pow(2).sum().backward()
            fresh_opt.step()
            fresh_opt.zero_grad(set_to_none=True)
        return fresh, fresh_opt

    (a, a_opt), (b, b_opt) = resumed(True), resumed(False)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    for (pa, sa), (pb, sb) in zip(a_opt.state.items(), b_opt.state.items(), strict=True):
        assert pa.shape == pb.shape and sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
