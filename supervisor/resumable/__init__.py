"""The training-side API: what a user's own loop imports to be resumable (imports torch).

    from supervisor.resumable import Identity, Resumable, Saves

Everything public is in ``__all__``; the modules beside this file are private (their names start
with ``_``) and may change. Nothing torch-free imports this package: the watchdog and the login-node
commands (``python -m supervisor status|ckpt|watch``) never load torch (tests/test_layers.py).

In a launch the watchdog started ahead of a failure (``watch --standby``, a hot spare), importing
this package is the standby's gate (``wait_if_standby``): the import returns once the watchdog
released the launch, so a user's loop that imports it before ``init_process_group`` (at the top,
as everyone does) waits there, imports done, without a call of its own. Anywhere else the import
does not wait.

Extension hooks of ``Resumable`` (override in a subclass, as the reference trainer does): see its
class docstring.

The adapters for the trainers users already run are in ``__all__`` too, imported on first use
(each needs its framework, an extra of its own): ``ResumableCallback`` (Lightning),
``AccelerateResumable`` (Accelerate), ``ResumableTrainerCallback`` (the Hugging Face ``Trainer``).
"""

from supervisor.clash import foreign_supervisor as _foreign_supervisor

if _clash := _foreign_supervisor():  # supervisord's files replaced modules this package imports
    raise ImportError(_clash)
try:
    import torch as _torch  # noqa: F401  (the one dependency of this package that the core install lacks)
except ModuleNotFoundError as e:  # one line naming the extra, not a bare "No module named torch"
    if e.name != "torch":  # torch is there but broken (a missing CUDA library...): its own error
        raise
    raise ImportError(
        "supervisor.resumable needs torch: pip install 'resumable-training[train]' "
        "(or bring your own torch, e.g. a CUDA build)"
    ) from None

from supervisor.resumable._devices import DeviceError, device_index
from supervisor.resumable._digest import full_tensor, params_digest, tensors_digest
from supervisor.resumable._exits import refuse_start
from supervisor.resumable._options import Identity, ResumeOptions, Saves
from supervisor.resumable._resumable import Resumable, install_signals
from supervisor.resumable._safe_load import load_dcp
from supervisor.resumable._sampler import ByIndex, ResumableBatchSampler, SampleKey, mix_seed
from supervisor.resumable._standby import wait_if_standby
from supervisor.resumable._tiering import RemoteOptions
from supervisor.resumable._train_state import TrainState

wait_if_standby()  # a standby launch waits here for its release (no-op otherwise, and once passed)

# name -> (private module, the extra that installs its framework): imported on first use, so
# ``import supervisor.resumable`` never imports Lightning, Accelerate or transformers.
_ADAPTERS = {
    "ResumableCallback": ("_lightning", "lightning"),
    "AccelerateResumable": ("_accelerate", "accelerate"),
    "ResumableTrainerCallback": ("_hf", "hf"),
}


def __getattr__(name: str) -> object:
    if name not in _ADAPTERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, extra = _ADAPTERS[name]
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "supervisor":
            raise
        raise ImportError(
            f"supervisor.resumable.{name} needs {e.name}: pip install 'resumable-training[{extra}]'"
        ) from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_ADAPTERS})


__all__ = [
    "AccelerateResumable",
    "ByIndex",
    "DeviceError",
    "Identity",
    "RemoteOptions",
    "Resumable",
    "ResumableBatchSampler",
    "ResumableCallback",
    "ResumableTrainerCallback",
    "ResumeOptions",
    "SampleKey",
    "Saves",
    "TrainState",
    "device_index",
    "full_tensor",
    "install_signals",
    "load_dcp",
    "mix_seed",
    "params_digest",
    "refuse_start",
    "tensors_digest",
    "wait_if_standby",
]
