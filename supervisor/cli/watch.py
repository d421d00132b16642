"""``python -m supervisor watch --ckpt-root DIR [options] -- COMMAND...``"""

from __future__ import annotations

import argparse

from supervisor import options
from supervisor.signing import add_signing_key_arg, load_key
from supervisor.watch import config, torchrun_cmd

EPILOG = """exit codes: 0 done; 10 restart budget exhausted; 11 no progress; 12 non-retryable child
failure or no usable checkpoint (reason in DIR/supervisor/events.jsonl); 13 preempted and
checkpointed, requeue me (--requeue-exit); 14 storage unavailable past --io-retry, requeue me;
2 usage (bad options only); 128+N stopped by signal N."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "watch",
        help="run COMMAND, detect crashes and hangs, resume from the newest valid checkpoint",
        description=__doc__,
        epilog=EPILOG,
    )
    options.add_options(p, config.WatchConfig)  # every flag, its default and help: on WatchConfig
    add_signing_key_arg(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=run, parser=p)


def _signing_key(args: argparse.Namespace) -> bytes | None:
    """--signing-key's key; a bad one is a one-line error (exit 2) before anything is launched."""
    if not args.signing_key:
        return None
    return load_key(args.signing_key, outside=(args.ckpt_root, args.remote))


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        args.parser.error("no COMMAND given; usage: watch --ckpt-root DIR [options] -- COMMAND...")
    cfg = options.build(config.WatchConfig, args, command=tuple(command), sign_key=_signing_key(args))
    if cfg.standby and not cfg.roster and torchrun_cmd.joins_other_nodes(command):
        args.parser.error(
            "--standby with a torchrun of more than one node (--nnodes): its standby would join the running "
            "launch's rendezvous; on SLURM set SPARE_NODES (the roster keeps every node's standby and releases "
            "them together, docs/slurm.md#hot-spares), else run each node's torchrun --standalone"
        )
    from supervisor.watch.loop import watch  # the loop and its process machinery: only when watching

    return watch(cfg)
