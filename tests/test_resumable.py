"""The public API (supervisor.resumable.Resumable) and the open phases: pure parts without processes, then
the object itself in two real gloo ranks (spawned processes, a tiny model)."""

from __future__ import annotations

import json
import multiprocessing as mp
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from waiting import PATIENCE_S, processes

from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase, parse_heartbeat
from supervisor.format.manifest import Manifest, ManifestError, parse_manifest
from supervisor.watch.detectors import detect_hangs
from supervisor.watch.liveness import Clock, PhaseTimeouts

BEAT = Heartbeat(
    rank=0, local_rank=0, host="h", pid=1, step=7, phase=Phase.TRAIN, wall_time=100.0, launch_id="L"
)


def _snap(hb: Heartbeat) -> list[HeartbeatSnapshot]:
    return [HeartbeatSnapshot(hb.rank, "p", hb)]


def test_a_custom_phase_round_trips_and_an_old_record_reads_without_one() -> None:
    hb = replace(BEAT, phase=Phase.CUSTOM, phase_name="eval", phase_timeout_s=600.0)
    back = parse_heartbeat(json.dumps(hb.to_dict()))
    assert (back.phase, back.phase_name, back.phase_timeout_s, back.label) == (
        Phase.CUSTOM,
        "eval",
        600.0,
        "eval",
    )
    old = {k: v for k, v in BEAT.to_dict().items() if k not in ("phase_name", "phase_timeout_s")}
    assert parse_heartbeat(json.dumps(old)) == BEAT
    assert BEAT.label == "train"


@pytest.mark.parametrize(
    ("declared", "silent", "hung", "limit"),
    [
        (600.0, 500.0, False, 600.0),
        (600.0, 700.0, True, 600.0),
        (0.0, 50.0, True, 30.0),
        (0.0, 20.0, False, 30.0),
    ],
)
def test_the_hang_detector_holds_a_custom_phase_to_its_own_timeout(declared, silent, hung, limit) -> None:
    """An eval of 10 minutes is not a hang when it declared 600 s; one that declared nothing is
    held to the train timeout; a verdict names the phase by its name."""
    hb = replace(BEAT, phase=Phase.CUSTOM, phase_name="eval", phase_timeout_s=declared)
    hangs = detect_hangs(
        _snap(hb),
        launch_id="L",
        launch_age_s=1e4,
        clock=Clock(wall=100.0 + silent),
        timeouts=PhaseTimeouts(train=30.0),
    )
    assert bool(hangs) is hung
    if hung:
        assert hangs[0].timeout_s == limit and "in phase eval at step 7" in hangs[0].reason, hangs[0].reason


def test_status_shows_a_custom_phase_by_its_name(tmp_path: Path) -> None:
    from supervisor.format.heartbeat import write_heartbeat
    from supervisor.report import build_report

    write_heartbeat(
        tmp_path, replace(BEAT, phase=Phase.CUSTOM, phase_name="data-refresh", phase_timeout_s=900.0)
    )
    rows = build_report(tmp_path).ranks
    assert [r.phase for r in rows] == ["data-refresh"]


def _manifest(**extra: object) -> str:
    m = Manifest(step=5, world_size=1, files={})
    d = json.loads(m.to_json())
    d.update(extra)
    return json.dumps(d)


def test_manifest_metrics_are_optional_numbers() -> None:
    assert parse_manifest(_manifest()).metrics == {}
    old = json.loads(_manifest())
    del old["metrics"]
    assert parse_manifest(json.dumps(old)).metrics == {}
    assert parse_manifest(_manifest(metrics={"loss": 2.5, "acc": 1})).metrics == {"loss": 2.5, "acc": 1.0}
    with pytest.raises(ManifestError, match="'metrics'"):
        parse_manifest(_manifest(metrics={"loss": "low"}))


def test_identity_hash_covers_the_seed_and_a_diff_names_the_fields() -> None:
    from supervisor.resumable import Identity
    from supervisor.resumable._resume import describe_diff, identity_diff

    a = Identity({"lr": 0.1, "amp": "off"}, seed=1)
    assert a.config_hash != replace(a, seed=2).config_hash
    assert a.config_hash != replace(a, fields={"lr": 0.1, "amp": "bf16"}).config_hash
    assert a.config_hash == Identity({"amp": "off", "lr": 0.1}, seed=1, name="other").config_hash
    diff = identity_diff(a.all_fields, {"lr": 0.2, "amp": "off", "seed": 1})
    assert describe_diff(diff) == "lr 0.1 -> 0.2"


def test_save_schedule_problems_name_the_flag() -> None:
    from supervisor.resumable import Saves

    assert Saves().problem() == ""
    assert Saves(every_steps=0, every_s=60).problem() == ""
    assert "--save-every" in Saves(every_steps=0).problem()
    assert "--keep 1" in Saves(keep=1).problem()
    assert "--max-failed-saves 0" in Saves(max_failed_saves=0).problem()


# ---------------------------------------------------------------- two real ranks


def _rank(rank: int, tmp: str, store: str, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from supervisor.format.heartbeat import read_heartbeats
    from supervisor.resumable import Identity, Resumable, Saves

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Time-based saves: rank 0's clock alone decides. Rank 1 would save at every step by its own
    # settings, rank 0 never by time: no rank saves by time.
    saves = Saves(every_steps=4, every_s=1e-9 if rank == 1 else 0.0, async_save=True)
    r = Resumable(
        Path(tmp) / "run", {"model": model, "optimizer": opt}, steps=6, identity=Identity(seed=3), saves=saves
    )
    hooked = len(opt._optimizer_step_pre_hooks)
    start = r.resume()
    staged, phase, after = [], None, None
    for step in range(start + 1, 7):
        loss = model(torch.ones(2, 4)).sum()
        loss_value = float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
        # The step after a save started: its staging was waited for by the hook.
        staged.append(r._ckpt.in_flight is None or r._ckpt.in_flight.staging is None)
        r.step_end(step, {"loss": loss_value})
        if step == 5:
            with r.phase("eval", timeout=77) as progress:
                progress()
                hb = next(s.heartbeat for s in read_heartbeats(Path(tmp) / "run") if s.rank == rank)
                phase = (hb.phase.value, hb.phase_name, hb.phase_timeout_s)
            after = next(s.heartbeat for s in read_heartbeats(Path(tmp) / "run") if s.rank == rank)
    digest = r.finish()
    out.put((rank, hooked, start, all(staged), phase, after and after.label, digest))
    dist.destroy_process_group()


def _two_ranks(tmp: Path) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # A store file per launch: a second launch on the first one's file can find its stale keys and
    # dial the first launch's dead ranks (seen once, under a busy loop on each core).
    store = str(tmp / f"store-{uuid.uuid4().hex}")
    with processes(ctx, [(_rank, (r, str(tmp), store, out)) for r in (0, 1)]) as procs:
        results = dict((r[0], r[1:]) for r in (out.get(timeout=PATIENCE_S) for _ in procs))
    assert [p.exitcode for p in procs] == [0, 0]
    return results


@pytest.mark.slow
def test_resumable_in_two_ranks_hooks_the_staging_wait_agrees_saves_and_declares_a_phase(
    tmp_path: Path,
) -> None:
    from supervisor.format.manifest import read_manifest

    res = _two_ranks(tmp_path)
    for rank in (0, 1):
        hooked, start, staged, phase, after, _digest = res[rank]
        assert hooked == 1 and start == 0 and staged
        assert phase == ("custom", "eval", 77.0)
        assert after == "train"
    assert res[0][-1] == res[1][-1]
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("step_*")) == ["step_00000004", "step_00000006"]
    m = read_manifest(run / "step_00000004")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m.metrics["loss"] == next(x["loss"] for x in lines if x["step"] == 4)
    # the losses the resume's sanity step compares with: those reported up to the saved step
    assert m.meta["recent_losses"] == [x["loss"] for x in lines if x["step"] <= 4]
    assert m.meta["identity"] == {"seed": 3}
    # A second launch resumes at the final step and has nothing left to do.
    res2 = _two_ranks(tmp_path)
    assert res2[0][1] == 6 and res2[0][-1] == res[0][-1]


# ---------------------------------------------------------------- --load-step and --init-from (rank 0's part)


def test_load_step_picks_that_step_and_moves_the_abandoned_future_aside(tmp_path: Path) -> None:
    from store_helpers import make_ckpt

    from supervisor import store
    from supervisor.resumable._resume import pick_step

    for step in (10, 20, 30):
        make_ckpt(tmp_path, step)
    v = pick_step(tmp_path, 20, store.Expectation(), None)
    assert v.ok and v.ref.step == 20
    assert [r.step for r in store.list_checkpoints(tmp_path)] == [20, 10]
    reasons = [(q / "reason.txt").read_text() for q in (tmp_path / "quarantine").iterdir()]
    assert reasons and all("--load-step 20" in r for r in reasons)
    with pytest.raises(store.StoreError, match=r"--load-step 15: .*committed steps: 10, 20"):
        pick_step(tmp_path, 15, store.Expectation(), None)


def test_init_from_names_a_checkpoint_that_passes_its_deep_check_and_moves_nothing(tmp_path: Path) -> None:
    from store_helpers import make_ckpt

    from supervisor.resumable._resumable import init_source

    for step in (10, 20):
        make_ckpt(tmp_path, step, {"a.bin": b"x" * 100})
    bad = tmp_path / "step_00000020" / "a.bin"
    bad.write_bytes(b"y" * 100)  # same size: only the checksum tells
    assert init_source(str(tmp_path)) == tmp_path / "step_00000010"
    assert "a.bin" in str(init_source(f"{tmp_path}:20"))
    assert "no committed step 15" in str(init_source(f"{tmp_path}:15"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000010",
        "step_00000020",
    ]
