"""Which CUDA device a rank uses, and which saved CUDA generator is this rank's at a resume.

Under torchrun every process may see all of the node's GPUs (then rank ``LOCAL_RANK`` takes device
``LOCAL_RANK``), or, under SLURM's GPU binding, exactly one (then device 0 of its own visible set):
``set_device(LOCAL_RANK)`` alone fails in the second case. A rank's CUDA RNG is saved as the state
of *its* device's generator with that device's identity (index in the visible set, UUID,
``CUDA_VISIBLE_DEVICES``) and restored onto whatever device the rank uses at the resume: another
rank-to-GPU mapping or fewer visible devices still continue each rank's own stream exactly.
Saving every visible device's state and restoring it by index (the earlier format) gave a rank
another rank's stream under another mapping, and crashed with fewer visible devices.

The decisions are pure functions (tested on CPU with fake devices); only ``current_cuda_device``
asks CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from supervisor.errors import UserError

ENV_VISIBLE = "CUDA_VISIBLE_DEVICES"


class DeviceError(UserError):
    """A device setup or saved CUDA state this rank cannot use; ``str(e)`` is one line with the fix."""


def device_index(local_rank: int, local_world_size: int, visible: int, visible_env: str) -> int:
    """The CUDA device (index in this process's visible set) of local rank ``local_rank``.

    Decided from counts every process of the node shares, so all of them agree on whether the
    setup is usable: each local rank has its own device in a shared set, or each process sees
    exactly one (per-process binding). Anything else would put two ranks on one GPU."""
    if visible >= local_world_size:
        return local_rank
    if visible == 1:
        return 0
    raise DeviceError(
        f"{local_world_size} ranks on this node but each process sees {visible} CUDA devices "
        f"({ENV_VISIBLE}={visible_env or 'unset'}): make every device visible to every process "
        f"(at least {local_world_size}) or bind exactly one to each process"
    )


@dataclass(frozen=True)
class CudaDevice:
    """A device as one process sees it: the index moves with the mapping, the UUID does not."""

    index: int  # torch.cuda.current_device(): in this process's visible set
    uuid: str  # the physical GPU ('' when torch cannot tell)
    visible: str  # CUDA_VISIBLE_DEVICES as this process saw it ('' unset)

    def describe(self) -> str:
        return f"cuda:{self.index} ({self.uuid or 'uuid unknown'}, {ENV_VISIBLE}={self.visible or 'unset'})"


def current_cuda_device() -> CudaDevice | None:
    """This process's current CUDA device, or None without CUDA (the only function here that asks CUDA)."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    return CudaDevice(index, uuid, os.environ.get(ENV_VISIBLE, ""))


def cuda_rng_record(state: torch.Tensor, dev: CudaDevice) -> dict[str, Any]:
    """The per-rank file's ``torch_rng.cuda`` entry: plain tensor, ints and strings (weights_only)."""
    return {"state": state, "index": dev.index, "uuid": dev.uuid, "visible": dev.visible}


def cuda_rng_to_restore(saved: Any, now: CudaDevice | None, source: str) -> tuple[torch.Tensor | None, str]:
    """The generator state to restore onto this rank's device now (None: nothing to restore), and a
    line for the log ('' when there is nothing to say). ``source`` names the file for errors.

    The saved state is this rank's own stream, whatever device it ran on: it goes onto the device
    the rank uses now. Raises DeviceError when the entry is not one (the earlier all-devices format
    does not say which device was this rank's: no exact restore is possible)."""
    if saved is None:
        if now is None:
            return None, ""
        return None, (
            f"{source} has no CUDA RNG state (saved without CUDA): the CUDA generator of "
            f"{now.describe()} keeps this launch's seed, not restored"
        )
    if not (isinstance(saved, Mapping) and {"state", "index", "uuid", "visible"} <= saved.keys()):
        raise DeviceError(
            f"{source}: its CUDA RNG entry is not this rank's own generator (the earlier format kept "
            f"every visible device's state by index and not which one this rank used), so it cannot "
            f"be restored exactly; resume from a checkpoint saved by this version"
        )
    was = CudaDevice(int(saved["index"]), str(saved["uuid"]), str(saved["visible"]))
    if now is None:
        return None, f"{source}: CUDA RNG saved on {was.describe()} not restored: no CUDA device now"
    moved = (
        "" if was == now else f"{source}: CUDA RNG saved on {was.describe()} restored onto {now.describe()}"
    )
    return saved["state"], moved
