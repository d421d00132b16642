"""``python -m supervisor watch --ckpt-root DIR [options] -- COMMAND...``"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from supervisor import slurm
from supervisor.signing import add_signing_key_arg, load_key
from supervisor.watch import config, restart_policy
from supervisor.watch.restart_policy import Backoff, Budget, PhaseTimeouts, RestartPolicy

EPILOG = """exit codes: 0 done; 10 restart budget exhausted; 11 no progress; 12 non-retryable child
failure or no usable checkpoint (reason in DIR/supervisor/events.jsonl); 13 preempted and
checkpointed, requeue me (--requeue-exit); 14 storage unavailable past --io-retry, requeue me;
2 usage (bad options only); 128+N stopped by signal N."""

# One flag per phase (restart_policy.PhaseTimeouts); --hang-timeout is the train phase's.
TIMEOUT_FLAGS = (
    ("--hang-timeout", restart_policy.DEFAULT_TRAIN_TIMEOUT_S, "the train phase (a step)"),
    (
        "--startup-timeout",
        restart_policy.DEFAULT_STARTUP_TIMEOUT_S,
        "startup (imports, rendezvous, building the model), or before any heartbeat",
    ),
    ("--verify-timeout", restart_policy.DEFAULT_VERIFY_TIMEOUT_S, "verify (checking a checkpoint's files)"),
    ("--download-timeout", restart_policy.DEFAULT_DOWNLOAD_TIMEOUT_S, "download (from the remote tier)"),
    ("--load-timeout", restart_policy.DEFAULT_LOAD_TIMEOUT_S, "load (reading a checkpoint)"),
    ("--save-timeout", restart_policy.DEFAULT_SAVE_TIMEOUT_S, "save (writing a checkpoint)"),
    ("--commit-timeout", restart_policy.DEFAULT_COMMIT_TIMEOUT_S, "commit (fsync, manifest, rename)"),
    ("--digest-timeout", restart_policy.DEFAULT_DIGEST_TIMEOUT_S, "digest (the final parameter digest)"),
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "watch",
        help="run COMMAND, detect crashes and hangs, resume from the newest valid checkpoint",
        description=__doc__,
        epilog=EPILOG,
    )
    p.add_argument("--ckpt-root", required=True, type=Path, help="the run's checkpoint root")
    p.add_argument("--verify", choices=("quick", "deep"), default="quick", help="check before each relaunch")
    g = p.add_argument_group(
        "hang detection (seconds without progress, per phase: a long phase that progresses is no hang)"
    )
    for flag, default, what in TIMEOUT_FLAGS:
        g.add_argument(flag, type=float, default=default, help=f"seconds without progress in {what}")
    g.add_argument(
        "--learn-hang-timeout",
        type=float,
        metavar="FACTOR",
        default=None,
        help="train timeout = max observed step time x FACTOR (at least --learn-floor) once steps are seen",
    )
    g.add_argument("--require-heartbeat", action="store_true", help=config.help_of("require_heartbeat"))
    g.add_argument("--learn-floor", type=float, default=restart_policy.DEFAULT_LEARN_FLOOR_S)
    g.add_argument(
        "--poll-interval", type=float, default=config.DEFAULT_POLL_S, help="heartbeat check period"
    )
    g.add_argument("--dump-wait", type=float, default=config.DEFAULT_DUMP_WAIT_S, help="wait for stack dumps")
    g.add_argument("--kill-grace", type=float, default=config.DEFAULT_KILL_GRACE_S, help="SIGTERM to SIGKILL")
    g.add_argument(
        "--stop-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="when the watchdog itself gets SIGTERM/SIGINT: SIGTERM to SIGKILL for its ranks, room for "
        "their checkpoint (default: --kill-grace)",
    )
    g.add_argument(
        "--reap-timeout",
        type=float,
        default=config.DEFAULT_REAP_TIMEOUT_S,
        help="after SIGKILL, seconds to wait before naming what could not be reaped (state D) and going on",
    )
    g.add_argument(
        "--dead-rank-grace",
        type=float,
        default=config.DEFAULT_DEAD_RANK_GRACE_S,
        help="seconds a rank gone without an exit code may be a clean exit before it counts as dead",
    )
    g.add_argument(
        "--notice-signal",
        type=_notice_signal,
        default=signal.SIGUSR1,
        metavar="SIG",
        help="the preemption notice's signal, taken and forwarded to the ranks: USR1 (default) or URG",
    )
    g.add_argument(
        "--preempt-fallback",
        type=float,
        default=config.DEFAULT_PREEMPT_FALLBACK_S,
        help="seconds a preemption notice waits for heartbeats before going to the ranks found in /proc",
    )
    io = p.add_argument_group("storage")
    io.add_argument(
        "--io-retry",
        type=float,
        default=config.IO_RETRY_S,
        metavar="SECONDS",
        help="retry unreadable checkpoints (EIO, ESTALE...) this long before a relaunch, then exit 14",
    )
    io.add_argument(
        "--allow-fresh-start",
        action="store_true",
        help="start from step 0 when no checkpoint is usable although the run has quarantined ones "
        "(pass the trainer's --allow-fresh-start too)",
    )
    r = p.add_argument_group("restart policy")
    r.add_argument(
        "--max-restarts", type=int, default=restart_policy.DEFAULT_MAX_RESTARTS, help="failed launches, total"
    )
    r.add_argument(
        "--max-restarts-per-window", type=int, default=restart_policy.DEFAULT_MAX_RESTARTS_PER_WINDOW
    )
    r.add_argument(
        "--window", type=float, default=restart_policy.DEFAULT_WINDOW_S, help="rate window in seconds"
    )
    r.add_argument(
        "--no-progress",
        type=int,
        default=restart_policy.DEFAULT_NO_PROGRESS_LAUNCHES,
        metavar="K",
        help="stop after K failed launches in a row without a newer checkpoint (0: never)",
    )
    r.add_argument("--backoff-initial", type=float, default=restart_policy.DEFAULT_BACKOFF_INITIAL_S)
    r.add_argument("--backoff-max", type=float, default=restart_policy.DEFAULT_BACKOFF_MAX_S)
    r.add_argument("--backoff-jitter", type=float, default=restart_policy.DEFAULT_BACKOFF_JITTER_S)
    r.add_argument("--reset-budget", action="store_true", help="forget restarts recorded in state.json")
    r.add_argument("--requeue-exit", action="store_true", help="after a preemption checkpoint, exit 13")
    r.add_argument("--standby", action="store_true", help=config.help_of("standby"))
    p.add_argument(
        "--node-rank",
        type=int,
        default=int(os.environ.get("SLURM_NODEID", "0") or 0),
        help="this node's index (default $SLURM_NODEID or 0); node N>0 keeps state.nodeN.json",
    )
    p.add_argument(
        "--no-share-store-fix",
        action="store_true",
        help=f"do not set {config.SHARE_STORE_ENV}=1 in the child's environment",
    )
    t = p.add_argument_group("remote tier (docs/tiers.md); pass the same --remote to the trainer")
    t.add_argument("--remote", help="shared directory or s3://bucket/prefix to resume from after node loss")
    t.add_argument("--remote-endpoint", help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    t.add_argument(
        "--remote-wait",
        type=float,
        default=config.DEFAULT_REMOTE_WAIT_S,
        help="seconds to retry an unreachable remote when nothing local is valid, then stop",
    )
    add_signing_key_arg(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=run, parser=p)


def _notice_signal(raw: str) -> signal.Signals:
    try:
        return slurm.notice_signal(raw, "--notice-signal")
    except slurm.SlurmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    for flag in (*(f for f, _, _ in TIMEOUT_FLAGS), "--poll-interval"):
        if getattr(args, flag[2:].replace("-", "_")) <= 0:
            args.parser.error(f"{flag} must be positive")
    if args.stop_grace is not None and args.stop_grace <= 0:
        args.parser.error("--stop-grace must be positive")
    for flag in ("--io-retry", "--reap-timeout", "--dead-rank-grace", "--preempt-fallback"):
        if getattr(args, flag[2:].replace("-", "_")) < 0:
            args.parser.error(f"{flag} must not be negative")
    cfg = config.WatchConfig(
        root=args.ckpt_root,
        command=tuple(command),
        node=args.node_rank,
        deep_verify=args.verify == "deep",
        timeouts=PhaseTimeouts(
            train=args.hang_timeout,
            startup=args.startup_timeout,
            verify=args.verify_timeout,
            download=args.download_timeout,
            load=args.load_timeout,
            save=args.save_timeout,
            commit=args.commit_timeout,
            digest=args.digest_timeout,
        ),
        learn_factor=args.learn_hang_timeout,
        learn_floor_s=args.learn_floor,
        policy=RestartPolicy(
            budget=Budget(args.max_restarts, args.max_restarts_per_window, args.window),
            backoff=Backoff(args.backoff_initial, args.backoff_max, args.backoff_jitter),
            no_progress_launches=args.no_progress,
            requeue_exit=args.requeue_exit,
        ),
        kill_grace_s=args.kill_grace,
        stop_grace_s=args.stop_grace,
        dump_wait_s=args.dump_wait,
        poll_s=args.poll_interval,
        reset_budget=args.reset_budget,
        share_store_fix=not args.no_share_store_fix,
        remote=args.remote,
        remote_endpoint=args.remote_endpoint,
        remote_wait_s=args.remote_wait,
        io_retry_s=args.io_retry,
        allow_fresh_start=args.allow_fresh_start,
        reap_timeout_s=args.reap_timeout,
        dead_rank_grace_s=args.dead_rank_grace,
        preempt_fallback_s=args.preempt_fallback,
        notice_signal=args.notice_signal,
        sign_key=_signing_key(args),
        require_heartbeat=args.require_heartbeat,
        standby=args.standby,
    )
    from supervisor.watch.loop import watch  # the loop and its process machinery: only when watching

    return watch(cfg)
