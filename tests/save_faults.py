"""ENOSPC at every point of a save (issue 44): the sweep, shared by tests/test_save_faults.py (one
trial per point in ``make test``) and ``make save-fault-sweep`` (20 per point, numbers printed):

    .venv/bin/python tests/save_faults.py --trials 20 [--workdir DIR]

The reference trainer (2 ranks, FSDP: each rank saves alone, the layout that hung; async saves, the
default) runs under ``supervisor watch`` with its run directory on the fault filesystem, saving at
every step. Each step's save is one trial: the fault filesystem fails one point of it with ENOSPC
(its rule's ``skip`` window picks the operation, never a time), set by the trainer's own step
boundary (tests/save_fault_hook.py). Points, from the operations one clean save makes (counted in
the uninterrupted reference run):

- each rank's files: its shard, its index, its state file: the open (create), every write, the
  close (flush), the fsync, the index's rename; from that operation on, every one of the same kind
  on that file fails (a disk that filled there and stays full for the rest of the save);
- rank 0's commit: the tmp dir's mkdir and fsync, the manifest's open, write, close and fsync, the
  tmp dir's rename; after the rename, ``latest``'s open, write, close, fsync and rename, and the
  two fsyncs of the run dir (once: the checkpoint is committed all the same, ``latest`` repaired
  by the next pick);
- random points: the k-th of all the writing operations in the save's tmp dir (either rank's), k
  drawn uniformly, and every one after it (the disk full from a random moment of the save on).

A trial passes when every rank recorded the same agreed outcome of that save (failed saves in a
row and the error: ``Checkpointer._apply`` sets them from rank 0's one outcome), the outcome the
point calls for (failed with ENOSPC and ``latest`` untouched, or committed), and the rule fired;
or when the launch ended in a hang verdict within the phase timeout + 1 s. Every run must end
digest-equal to an uninterrupted run, with no tmp dir left.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script too

from commands import REPO, supervisor_cmd  # noqa: E402
from save_fault_hook import ENV_PLAN, records_dir  # noqa: E402
from sweep_cli import run_and_report  # noqa: E402
from trainer_helpers import digest, run_ok, torchrun_cmd, train_args, trainer_env  # noqa: E402

from supervisor import store  # noqa: E402
from supervisor.drill.faultctl import FaultFS  # noqa: E402
from supervisor.format.events import events_path, read_events  # noqa: E402
from supervisor.format.hooks import ENV_BOUNDARY_HOOK  # noqa: E402

PARALLEL = "fsdp"
# The watchdog's timeouts for the sweep: a hang verdict must come within PHASE_TIMEOUT_S + 1 s.
PHASE_TIMEOUT_S = 20.0
WATCH = [
    "--poll-interval", "0.2", "--kill-grace", "1", "--reap-timeout", "1", "--dump-wait", "1",
    "--backoff-initial", "0.5", "--backoff-jitter", "0", "--startup-timeout", "120", "--hang-timeout", "60",
    "--save-timeout", f"{PHASE_TIMEOUT_S:g}", "--commit-timeout", f"{PHASE_TIMEOUT_S:g}",
]  # fmt: skip
# Every save fails but a few: the give-up policy is out of reach, and every checkpoint is kept
# (the committed ones are part of what a trial checks).
TRAIN = ("--max-failed-saves", "100000", "--keep-all")
TRIALS_PER_RUN = 80  # every run has the steps of this many (the rest clean): one reference fits all
CLEAN_BEFORE = 1  # step 1's save is clean (the first save decides the index layout)
STEPS = CLEAN_BEFORE + TRIALS_PER_RUN + 2  # ... the trials, the save that records the last, the end
DISCOVERY_STEPS = (2, 3, 4)  # clean saves whose operations the reference run counts
WRITING = ("create", "open", "write", "flush", "fsync", "fsyncdir", "mkdir", "rename")
FILE_OPS = ("create", "open", "write", "flush", "fsync", "rename")
RUN_TIMEOUT_S = 1800.0


def tmp_glob(step: int) -> str:
    return f"/run/step_{step:08d}.tmp.*"


@dataclass(frozen=True)
class Point:
    """Where one save fails: ``ops`` on paths matching ``pattern`` ({tmp}: the save's tmp dir glob,
    {step}: its step), from the operation after the first ``skip`` on (``count`` None) or that one
    only; set at the trainer's ``when`` boundary; ``commits``: the save commits all the same."""

    name: str
    pattern: str
    ops: tuple[str, ...]
    skip: int = 0
    count: int | None = None
    when: str = "step"
    commits: bool = False
    latest_moves: bool = False  # committed, and ``latest`` names it (the fault came after its rename)

    def rule(self, step: int) -> dict[str, Any]:
        pattern = self.pattern.format(tmp=tmp_glob(step), step=f"{step:08d}")
        rule: dict[str, Any] = {
            "action": "error",
            "errno": "ENOSPC",
            "pattern": pattern,
            "ops": list(self.ops),
        }
        if self.skip:
            rule["skip"] = self.skip
        if self.count is not None:
            rule["count"] = self.count
        return rule


def rank_files(rank: int) -> dict[str, str]:
    return {
        f"rank {rank} shard": f"{{tmp}}/__{rank}_0.distcp",
        f"rank {rank} index": f"{{tmp}}/__{rank}.metadata*",  # DCP's tmp name, renamed to its own
        f"rank {rank} state file": f"{{tmp}}/rank_{rank:05d}*",
    }


# (name, pattern, ops) counted per save: each rank's files, rank 0's commit inside the tmp dir...
IN_SAVE = [(name, pat, op) for r in (0, 1) for name, pat in rank_files(r).items() for op in FILE_OPS]
IN_SAVE += [("tmp dir", "{tmp}", "mkdir"), ("tmp dir", "{tmp}", "fsyncdir")]
IN_SAVE += [("manifest", "{tmp}/manifest*", op) for op in FILE_OPS]
IN_SAVE += [("tmp dir -> step dir", "/run/step_{step}", "rename")]
ALL_WRITING = ("all writing operations", "{tmp}", ",".join(WRITING))
# ... and after the rename (counted over the run, per commit)
AFTER_RENAME = [("latest", "/run/.latest.*", op) for op in ("create", "write", "flush", "fsync")]
AFTER_RENAME += [("latest", "/run/latest", "rename"), ("run dir", "/run", "fsyncdir")]
# (A failure there leaves ``latest`` naming the checkpoint before: the next pick repairs it.)


@dataclass
class Counts:
    """Operations of one clean save, per (name, pattern, op): the fewest over the saves counted."""

    in_save: dict[tuple[str, str, str], int]
    per_commit: dict[tuple[str, str, str], int]


def points(counts: Counts, random_trials: int, seed: int) -> list[Point]:
    """Every point of a save, then ``random_trials`` random ones."""
    out = []
    for (name, pat, op), n in counts.in_save.items():
        if (name, pat, op) == ALL_WRITING:
            continue
        out += [Point(f"{name} {op} #{k + 1}/{n}", pat, (op,), skip=k) for k in range(n)]
    for (name, pat, op), n in counts.per_commit.items():
        for k in range(n):
            # the run dir's second fsync is latest's own, after its rename; the first comes before it
            moves = name == "run dir" and k == 1
            out.append(
                Point(f"{name} {op} #{k + 1}/{n} (after the rename)", pat, (op,), k, 1, "save", True, moves)
            )
    total = counts.in_save[ALL_WRITING]
    rng = random.Random(seed)
    for _ in range(random_trials):
        k = rng.randrange(total)
        out.append(Point(f"random: writing op #{k + 1}/{total} on", "{tmp}", WRITING, skip=k))
    return out


# ---------------------------------------------------------------- the reference run


def reference(base: Path) -> tuple[str, Counts]:
    """An uninterrupted run on the fault filesystem, its digest, and what its clean saves did."""
    steps = STEPS
    with FaultFS.start(base / "ref-backing", base / "ref-mnt") as fs:
        root = fs.mountpoint / "run"
        in_save: dict[tuple[str, str, str], list[str]] = {}
        for key in [*IN_SAVE, ALL_WRITING]:
            _name, pat, ops = key
            in_save[key] = [
                fs.delay(pat.format(tmp=tmp_glob(s), step=f"{s:08d}"), 1e-6, ops=ops.split(","))
                for s in DISCOVERY_STEPS
            ]
        per_commit = {key: fs.delay(key[1], 1e-6, ops=[key[2]]) for key in AFTER_RENAME}
        run_ok(root, 2, *train_args(PARALLEL, *TRAIN, steps=steps, save_every=1))
        status = fs.status().rules
        counts = Counts({}, {})
        for key, ids in in_save.items():
            n = min(status[i]["hits"] for i in ids)
            if n:
                counts.in_save[key] = n
        commits = len(store.list_checkpoints(root))
        assert commits == steps, f"the reference run committed {commits} of {steps} saves"
        for key, rid in per_commit.items():
            counts.per_commit[key] = status[rid]["hits"] // commits  # the rest are not commits' (final.json)
        return digest(root), counts


# ---------------------------------------------------------------- one run of trials


@dataclass
class Trial:
    point: Point
    step: int
    rule: str = ""  # the fault filesystem's rule id, once set
    verdict: str = ""  # "agreed", "hang" or what went wrong


@dataclass
class RunResult:
    trials: list[Trial]
    problems: list[str]  # the run's own (exit code, digest, leftovers)
    wall_s: float


def run_trials(base: Path, pts: list[Point], ref_digest: str) -> RunResult:
    """One watched run whose saves at steps CLEAN_BEFORE+1 ... are the trials of ``pts``, in order."""
    first = CLEAN_BEFORE + 1
    assert len(pts) <= TRIALS_PER_RUN
    trials = [Trial(p, first + i) for i, p in enumerate(pts)]
    steps = STEPS
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    t0 = time.monotonic()
    with FaultFS.start(base / "backing", base / "mnt") as fs:
        root = fs.mountpoint / "run"
        plan = base / "plan.json"
        rules = {str(t.step): {"when": t.point.when, "rule": t.point.rule(t.step)} for t in trials}
        plan.write_text(json.dumps({"control": str(fs.control), "root": str(root), "rules": rules}))
        env = trainer_env(**{ENV_PLAN: str(plan), ENV_BOUNDARY_HOOK: "save_fault_hook:hook"})
        env["PYTHONPATH"] = f"{HERE}{os.pathsep}{env['PYTHONPATH']}"
        trainer = torchrun_cmd(root, 2, *train_args(PARALLEL, *TRAIN, steps=steps, save_every=1))
        argv = [*supervisor_cmd("watch", "--ckpt-root", str(root), *WATCH), "--", *trainer]
        p = _watch(argv, env)
        hits = {rid: r["hits"] for rid, r in fs.status().rules.items()}
        problems = _run_problems(p, root, ref_digest, steps)
        _judge(trials, base, root, hits)
    return RunResult(trials, problems, time.monotonic() - t0)


def _watch(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The watchdog's run, its output; past RUN_TIMEOUT_S (a bound on a broken product, never
    reached by one that works) it gets SIGTERM, which stops its whole tree, then SIGKILL."""
    p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        out = f"timed out after {RUN_TIMEOUT_S:g}s\n{out}"
    return subprocess.CompletedProcess(argv, p.returncode, out, "")


def _run_problems(p: subprocess.CompletedProcess[str], root: Path, ref_digest: str, steps: int) -> list[str]:
    out = []
    if p.returncode != 0:
        out.append(f"the watchdog exited {p.returncode}: {p.stdout[-3000:]}")
        return out
    if (got := digest(root)) != ref_digest:
        out.append(f"digest {got} != the uninterrupted run's {ref_digest}")
    if left := [t.path.name for t in store.list_tmp(root)]:
        out.append(f"tmp dirs left: {left}")
    if (latest := store.read_latest(root)) != f"step_{steps:08d}":
        out.append(f"latest is {latest}, not the final step's")
    return out


def _records(base: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(records_dir(base / "plan.json").glob("rank_*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def _hang_silences(root: Path) -> dict[str, float]:
    """The launches that ended in a hang verdict, with the longest silence the verdict gave."""
    out = {}
    evs = read_events(events_path(root))
    launch_ids = {e.get("launch"): e.get("launch_id") for e in evs if e["event"] == "launch"}
    for e in evs:
        if e["event"] == "launch_end" and e.get("outcome") == "hang":
            hang = [h for h in evs if h["event"] == "hang" and h["t"] <= e["t"]][-1]
            silences = [float(x) for x in re.findall(r"made no progress for ([\d.]+)s", hang["msg"])]
            out[launch_ids[e["launch"]]] = max(silences, default=0.0)
    return out


def _judge(trials: list[Trial], base: Path, root: Path, hits: dict[str, int]) -> None:
    """Each trial's verdict from the ranks' records (its launch's: a relaunch runs it again)."""
    outcome: dict[tuple[str, int], dict[int, dict[str, Any]]] = defaultdict(dict)  # (launch, step) -> rank ->
    rule_of: dict[tuple[str, int], str] = {}
    for r in _records(base):
        if "rule" in r:
            rule_of[(r["launch"], r["step"])] = r["rule"]
        else:
            outcome[(r["launch"], r["outcome_of"])][r["rank"]] = r
    hung = _hang_silences(root)
    for t in trials:
        launches = [launch for launch, step in rule_of if step == t.step]
        if not launches:
            t.verdict = "never set: its step never ran"
            continue
        launch = launches[-1]  # its last run; an earlier one that hung is judged below
        t.rule = rule_of[(launch, t.step)]
        for other in launches[:-1]:
            if other not in hung:
                t.verdict = f"launch {other} ran it and ended without a hang verdict or a record"
        if t.verdict:
            continue
        t.verdict = _verdict(
            t, outcome.get((launch, t.step), {}), outcome.get((launch, t.step - 1), {}), hits
        )
        if t.verdict != "agreed" and launch in hung:
            silent = hung[launch]
            t.verdict = (
                "hang" if silent <= PHASE_TIMEOUT_S + 1 else f"hang verdict after {silent:g}s of silence"
            )


def _verdict(
    t: Trial, now: dict[int, dict[str, Any]], before: dict[int, dict[str, Any]], hits: dict[str, int]
) -> str:
    if sorted(now) != [0, 1]:
        return f"ranks {sorted(now)} recorded the outcome"
    seen = {(r["failures"], r["error"]) for r in now.values()}
    if len(seen) != 1:
        return f"the ranks disagree: {sorted(seen)}"
    if not hits.get(t.rule):
        return "its rule never fired"
    (failures, error), latest = next(iter(seen)), now[0]["latest"]
    if t.point.commits:
        if failures:
            return f"failed ({error}), should have committed"
        want = f"step_{t.step:08d}" if t.point.latest_moves else before.get(0, {}).get("latest")
        if latest != want:
            return f"committed, latest {latest}, not {want}"
        return "agreed"
    if not failures or "ENOSPC" not in error:
        return f"not failed with ENOSPC: {failures} failures, {error!r}"
    if 0 in before and latest != before[0]["latest"]:
        return f"latest moved from {before[0]['latest']} to {latest}"
    return "agreed"


# ---------------------------------------------------------------- the sweep


@dataclass
class Sweep:
    counts: Counts
    runs: list[RunResult]
    wall_s: float

    def failures(self) -> list[str]:
        out = [p for r in self.runs for p in r.problems]
        bad = [t for r in self.runs for t in r.trials if t.verdict not in ("agreed", "hang")]
        out += [f"step {t.step}, {t.point.name}: {t.verdict}" for t in bad]
        return out

    def report(self) -> str:
        lines = [f"{'point':60} pass/trials  (agreed, hang)"]
        verdicts: dict[str, Counter[str]] = defaultdict(Counter)
        for r in self.runs:
            for t in r.trials:
                key = "random points" if t.point.name.startswith("random") else t.point.name
                verdicts[key][t.verdict] += 1
        for key, c in sorted(verdicts.items(), key=lambda kv: _natural(kv[0])):
            ok = c["agreed"] + c["hang"]
            lines.append(f"{key:60} {ok:>4}/{sum(c.values()):<6} ({c['agreed']}, {c['hang']})")
        trials = sum(len(r.trials) for r in self.runs)
        lines.append(
            f"{trials} trials in {len(self.runs)} runs, {self.wall_s:.0f}s in all "
            f"(runs {', '.join(f'{r.wall_s:.0f}s' for r in self.runs)})"
        )
        return "\n".join(lines)


def _natural(name: str) -> list[Any]:
    """'rank 0 shard write #2/58' before '#10/58'."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def sweep(base: Path, trials_per_point: int, random_trials: int, seed: int = 44) -> Sweep:
    t0 = time.monotonic()
    ref_digest, counts = reference(base / "reference")
    pts = points(counts, 0, seed) * trials_per_point
    pts += [p for p in points(counts, random_trials, seed) if p.name.startswith("random")]
    random.Random(seed).shuffle(pts)  # neighbours differ from run to run: each trial's past varies
    runs = [
        run_trials(base / f"run{i}", pts[at : at + TRIALS_PER_RUN], ref_digest)
        for i, at in enumerate(range(0, len(pts), TRIALS_PER_RUN))
    ]
    return Sweep(counts, runs, time.monotonic() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per point")
    ap.add_argument("--random", type=int, default=None, help="random points (default: 20 x --trials)")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed")
    args = ap.parse_args()
    n_random = args.random if args.random is not None else 20 * args.trials
    return run_and_report(args.workdir, "save-faults-", lambda work: sweep(work, args.trials, n_random))


if __name__ == "__main__":
    raise SystemExit(main())
