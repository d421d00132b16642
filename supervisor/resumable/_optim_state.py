"""Optimizer state allocated for a load to fill, instead of computed for it to overwrite.

DCP loads in place: ``get_state_dict`` hands it the tensors to read into. An optimizer that has
not stepped has none, so torch 2.13 (``_init_optim_state``) makes them by giving every parameter a
zero gradient and running one ``step()`` with the learning rate at 0: every state tensor computed
only for the load to overwrite it. A resume loads into a fresh optimizer, and in the bench config
that step was 0.2-0.45 s of a rank's 0.25-0.8 s load (bench/first_load.py, docs/measured.md).

``prime_for_load`` gives an Adam or AdamW (exactly those classes: a subclass may keep other state)
the state its first step would create, keys, dtypes, shapes and placement as torch 2.13's
``Adam._init_group`` makes them, all zeros, with nothing computed. The load then overwrites every
tensor, or fails: DCP refuses a checkpoint that lacks one. Had it not loaded them, zeros at step
0 are what the first step creates anyway. Any other optimizer, or one torch itself would leave
without state (a gradient already there), is left to torch's way. tests/test_optim_state.py holds
the result against torch's own.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["prime_for_load"]

_ADAM = (torch.optim.Adam, torch.optim.AdamW)


def prime_for_load(optimizer: torch.optim.Optimizer | None) -> bool:
    """Allocate ``optimizer``'s state for a load (see above); whether it did."""
    if optimizer is None or type(optimizer) not in _ADAM or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(g["differentiable"] for g in groups) or any(
        p.grad is not None for g in groups for p in g["params"]
    ):
        return False
    for group in groups:
        for p in group["params"]:
            if p.requires_grad:  # torch gives a zero gradient, and so state, to these alone
                optimizer.state[p] = _adam_state(p, group)
    return True


def _adam_state(p: torch.Tensor, group: dict[str, object]) -> dict[str, torch.Tensor]:
    fused, capturable = bool(group["fused"]), bool(group["capturable"])
    step = (
        torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
        if capturable or fused
        else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
    )
    state = {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state
