"""The parameters' moving average (train_ref/ema.py) as a unit: its arithmetic, its reset and its
state. Its resume under DCP, sharded, is tests/test_train_resume.py's EMA case; that it is state
that matters, tests/test_train_ablation.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from train_ref.ema import EMA


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    m[1].bias.requires_grad_(False)  # frozen: not averaged
    return m


def test_each_update_moves_the_average_a_decay_step_toward_the_parameters():
    m = model()
    ema = EMA(m, 0.75)
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    ema.update()
    assert set(ema.state_dict()) == {"0.weight", "0.bias", "1.weight"}
    for name, avg in ema.state_dict().items():
        expected = 0.75 * start[name] + 0.25 * (start[name] + 1.0)
        torch.testing.assert_close(avg, expected, rtol=0, atol=1e-6)


def test_reset_starts_the_average_at_the_parameters_as_they_are():
    m = model()
    ema = EMA(m, 0.9)
    with torch.no_grad():
        m[0].weight.mul_(3.0)
    ema.reset()
    assert torch.equal(ema.state_dict()["0.weight"], m[0].weight)


def test_its_state_loads_into_another_bit_for_bit():
    a, b = EMA(model(), 0.9), EMA(model(), 0.9)
    with torch.no_grad():
        a.shadow["0.weight"].uniform_()
    b.load_state_dict({k: v.clone() for k, v in a.state_dict().items()})
    assert a.digest() == b.digest()
    b.update()
    assert a.digest() != b.digest()


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5])
def test_a_decay_outside_0_1_is_refused_naming_it(decay):
    with pytest.raises(ValueError, match=f"EMA decay {decay} refused"):
        EMA(model(), decay)
