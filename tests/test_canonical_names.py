"""A model's canonical names kept across torch's state-dict calls (supervisor/resumable/_canonical_names.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from supervisor.resumable._canonical_names import CanonicalNames
from supervisor.resumable._objects import Objects


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 2))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # the optimizer has state to name
    return model, optimizer


@pytest.fixture
def walks(monkeypatch) -> list[str]:
    """The names torch's own ``_get_fqns`` walked the module tree for."""
    real = torch_state_dict._get_fqns
    seen: list[str] = []

    def counted(model, name, *args, **kwargs):
        seen.append(name)
        return real(model, name, *args, **kwargs)

    monkeypatch.setattr(torch_state_dict, "_get_fqns", counted)
    return seen


def test_the_state_dict_is_torchs_and_each_name_is_walked_once(walks) -> None:
    model, optimizer = _model_and_optimizer(0)
    plain_model, plain_optim = get_state_dict(model, optimizer)
    per_call = len(walks)
    names = CanonicalNames(model)
    for _ in range(3):
        with names.kept():
            kept_model, kept_optim = get_state_dict(model, optimizer)
        assert kept_model.keys() == plain_model.keys()
        assert all(torch.equal(kept_model[k], plain_model[k]) for k in plain_model)
        assert kept_optim["param_groups"] == plain_optim["param_groups"]
        assert kept_optim["state"].keys() == plain_optim["state"].keys()
    # the first call inside walked each distinct name once; the later ones walked none
    distinct = len(set(walks[:per_call]))
    assert len(walks) == per_call + distinct and distinct < per_call


def test_resumables_state_walks_each_name_once_across_its_calls(walks) -> None:
    """``Resumable``'s state (a plain loop's model and optimizer) keeps its names too: the memory
    tier takes its state dict every step."""
    model, optimizer = _model_and_optimizer(0)
    plain_model, _ = get_state_dict(model, optimizer)
    per_call = len(walks)
    state = Objects({"model": model, "optimizer": optimizer})
    first = state.state_dict()
    walked = len(walks) - per_call
    for _ in range(2):
        again = state.state_dict()
        assert again["model"].keys() == plain_model.keys() == first["model"].keys()
        assert all(torch.equal(again["model"][k], plain_model[k]) for k in plain_model)
    assert 0 < walked < per_call and len(walks) == per_call + walked
    state.load_state_dict(first)
    loaded = len(walks)
    state.load_state_dict(first)  # a load's own walks, kept as well
    assert len(walks) == loaded


def test_a_load_through_the_kept_names_restores_the_state(walks) -> None:
    model, optimizer = _model_and_optimizer(0)
    saved_model, saved_optim = get_state_dict(model, optimizer)
    saved_model = {k: v.clone() for k, v in saved_model.items()}
    other, other_optim = _model_and_optimizer(1)
    names = CanonicalNames(other)
    with names.kept():
        get_state_dict(other, other_optim)
        set_state_dict(other, other_optim, model_state_dict=saved_model, optim_state_dict=saved_optim)
    got, _ = get_state_dict(other, other_optim)
    assert all(torch.equal(got[k], saved_model[k]) for k in saved_model)


def test_another_models_names_go_through_and_torch_is_left_as_it_was(walks) -> None:
    model, _ = _model_and_optimizer(0)
    stranger, stranger_optim = _model_and_optimizer(1)
    counted = torch_state_dict._get_fqns
    names = CanonicalNames(model)
    with names.kept():
        get_state_dict(stranger, stranger_optim)
        first = len(walks)
        get_state_dict(stranger, stranger_optim)
        assert len(walks) == 2 * first  # walked again: not kept
    assert torch_state_dict._get_fqns is counted
    with pytest.raises(RuntimeError), names.kept():
        raise RuntimeError("a failed call")
    assert torch_state_dict._get_fqns is counted


def test_a_torch_without_the_walk_is_left_alone(monkeypatch) -> None:
    monkeypatch.delattr(torch_state_dict, "_get_fqns")
    model, _ = _model_and_optimizer(0)
    with CanonicalNames(model).kept():
        pass
    assert not hasattr(torch_state_dict, "_get_fqns")
