"""The exponential moving average of the model's parameters: the "shadow" model many recipes
evaluate and ship, and state like any other (a resume that loses it silently restarts it).

Each average lives where its parameter does (a DTensor shard under fsdp, the whole tensor under
ddp), so DCP saves it sharded like the parameters and reshards it on a world-size change, and an
update touches local memory only, no collective. After every optimizer step, on every rank:
``shadow += (1 - decay) * (param - shadow)`` (``torch._foreach_lerp_``), bit-for-bit
deterministic on CPU. A ``Stateful``: a plain loop passes it to ``Resumable`` as one more object
(``{"model": ..., "optimizer": ..., "ema": EMA(model, 0.999)}``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from supervisor.resumable import tensors_digest


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class EMA(Stateful):
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay {decay} refused: give a number between 0 and 1 (0.999 is usual)")
        self.decay = decay
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, after the optimizer's step."""
        shadow = [_local(s) for s in self.shadow.values()]
        torch._foreach_lerp_(shadow, [_local(p.detach()) for p in self.params.values()], 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average at the parameters as they are now: at step 0, whether built here or
        loaded from another run (``--init-from``)."""
        for s, p in zip(self.shadow.values(), self.params.values(), strict=True):
            _local(s).copy_(_local(p.detach()))

    def state_dict(self) -> dict[str, Any]:
        return dict(self.shadow)  # the tensors themselves: DCP loads into them in place

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, t in self.shadow.items():
                if sd[name] is not t:
                    t.copy_(sd[name])

    def digest(self, progress: Callable[[int], None] | None = None) -> str:
        """sha256 of the averages as ``params_digest`` takes it of the parameters (a collective)."""
        return tensors_digest(self.shadow.items(), progress)
