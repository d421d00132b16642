"""What the watchdog reads off a torchrun COMMAND: whether torchrun may restart its ranks itself.

torchrun's agent restarts its worker group on its own when ``--max-restarts`` > 0 and a rank
fails, and, in a multi-node elastic run, whenever a node joins. With gloo the restarted group
hangs on the agent's shared TCPStore unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(docs/architecture.md). That setting has a cost: the agent then picks the ranks' port by binding port
0 and closing it, and rank 0 binds it seconds later, after its imports; another process can take
the port in between (EADDRINUSE). A single-node torchrun with no restarts of its own never
restarts its group (the watchdog relaunches it whole, with a new agent and a new store), so it
keeps torch's default, which has no such window.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = ["joins_other_nodes", "restarts_inside"]

# torchrun's options that take no value; every other option does, after "=" or as the next word.
_FLAGS = frozenset(
    {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}
)


def _torchrun_args(cmd: Sequence[str]) -> list[str] | None:
    """torchrun's own options in ``cmd`` (up to its training script), or None when ``cmd`` is
    not a torchrun (``torchrun ...`` or ``python -m torch.distributed.run ...``)."""
    for i, word in enumerate(cmd):
        if os.path.basename(word) == "torchrun":
            rest = cmd[i + 1 :]
            break
        if word == "torch.distributed.run" and i > 0 and cmd[i - 1] == "-m":
            rest = cmd[i + 1 :]
            break
    else:
        return None
    out: list[str] = []
    words = iter(rest)
    for word in words:
        if not word.startswith("-"):
            break  # the training script: what follows is its own
        out.append(word)
        if word not in _FLAGS and "=" not in word:
            out.append(next(words, ""))
    return out


def _value(args: list[str], *names: str) -> str | None:
    for i, word in enumerate(args):
        key, eq, value = word.partition("=")
        if key in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return None


def _max_nodes(args: list[str]) -> int | None:
    """The most nodes torchrun's ``--nnodes`` (N or MIN:MAX) allows; None when it cannot be read."""
    nnodes = "1" if "--standalone" in args else (_value(args, "--nnodes") or "1")
    return int(nnodes.split(":")[-1]) if re.fullmatch(r"[0-9]+(:[0-9]+)?", nnodes) else None


def restarts_inside(cmd: Sequence[str]) -> bool:
    """Whether torchrun in ``cmd`` may restart its worker group itself: more than one node (a
    join restarts it), or ``--max-restarts`` above 0. True when ``cmd`` is not a torchrun or an
    option cannot be read (the setting is then kept, as it always was)."""
    args = _torchrun_args(cmd)
    if args is None:
        return True
    restarts = _value(args, "--max-restarts", "--max_restarts") or "0"
    nodes = _max_nodes(args)
    if not re.fullmatch(r"[0-9]+", restarts) or nodes is None:
        return True
    return int(restarts) > 0 or nodes > 1


def joins_other_nodes(cmd: Sequence[str]) -> bool:
    """Whether torchrun in ``cmd`` rendezvouses with other nodes (``--nnodes`` above 1, or not
    readable): a standby of it would join the running launch's rendezvous. False for a command
    that is not a torchrun (its ranks' group is its own business)."""
    args = _torchrun_args(cmd)
    if args is None:
        return False
    nodes = _max_nodes(args)
    return nodes is None or nodes > 1
