"""Imported first by the reference trainer's entry points (``python -m train_ref.train``,
``python -m train_ref.gpu_check``): without torch they stop with one line naming the extra to
install, not a traceback from deep inside an import."""

from importlib.util import find_spec

MESSAGE = "train_ref needs torch: pip install 'resumable-training[train]' (or bring your own torch, e.g. a CUDA build)"

if find_spec("torch") is None:
    raise SystemExit(MESSAGE)
