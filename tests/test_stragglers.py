"""The straggler judge (supervisor/watch/stragglers.py) on synthetic step-time series: its
properties under hypothesis (scale and relabelling change nothing; a rank that computes FACTOR
times every peer's time at every step is flagged, one under it never; spikes within the trimmed
fraction flag nothing; identical ranks flag nothing; the flag holds down to ``clear``) and the
cases by name (network-slow against compute-slow, a CPU quota's bursts, stale ranks, the window);
then node 0's watch (straggler_watch.py): its events, what it publishes, whose beats it reads, and
`status` showing its flags."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.cli.status import render
from supervisor.format import eventtypes as ev
from supervisor.format.events import EventLog, events_path, read_logged
from supervisor.format.heartbeat import Heartbeat, Phase, StepTime, read_heartbeat_folder, write_heartbeat_in
from supervisor.format.nodesummary import write_summary
from supervisor.report import build_report
from supervisor.watch.liveness import Clock, PhaseTimeouts
from supervisor.watch.node_summary import NodeFacts, build_summary
from supervisor.watch.straggler_watch import StragglerWatch
from supervisor.watch.stragglers import (
    Kind,
    Params,
    Verdict,
    judge,
    scores,
    stragglers,
    trimmed_mean,
    window_of,
)

P = Params(hold=1)  # factor 1.3, window 20, trim 0.1; a score flags at once (the hold: its own tests)


def series(
    computes: Sequence[float], waits: Sequence[float] | None = None, start: int = 1, marked: bool = True
):
    waits = waits if waits is not None else [0.0] * len(computes)
    return [StepTime(start + i, c, w, marked) for i, (c, w) in enumerate(zip(computes, waits, strict=True))]


def run(
    ranks: dict[int, Sequence[float]], waits: dict[int, Sequence[float]] | None = None, flagged=None, params=P
):
    waits = waits or {}
    return judge({r: series(c, waits.get(r)) for r, c in ranks.items()}, flagged or {}, params)


times = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)
window_steps = st.lists(times, min_size=P.window, max_size=P.window)


@st.composite
def runs(draw: st.DrawFn, min_ranks: int = 2, max_ranks: int = 6) -> dict[int, list[float]]:
    n = draw(st.integers(min_ranks, max_ranks))
    return {r: draw(window_steps) for r in range(n)}


@given(runs(), st.integers(-10, 10))
def test_scaling_every_time_changes_no_verdict(ranks: dict[int, list[float]], k: int) -> None:
    """By a power of two, exact in floating point: a verdict on the threshold stays on it."""
    base = {r: (v.kind, v.value) for r, v in run(ranks).items()}
    scaled = run({r: [x * 2.0**k for x in xs] for r, xs in ranks.items()})
    assert {r: (v.kind, v.value) for r, v in scaled.items()} == base


@given(runs(), st.randoms(use_true_random=False))
def test_relabelling_ranks_relabels_the_verdicts(ranks: dict[int, list[float]], rnd: random.Random) -> None:
    labels = list(range(100, 100 + len(ranks)))
    rnd.shuffle(labels)
    relabel = dict(zip(ranks, labels, strict=True))
    before = {relabel[r]: v.kind for r, v in run(ranks).items()}
    after = {r: v.kind for r, v in run({relabel[r]: xs for r, xs in ranks.items()}).items()}
    assert after == before


@given(runs(min_ranks=2), st.integers(0, 5), st.floats(min_value=1.35, max_value=20.0))
def test_a_rank_that_computes_factor_times_every_peer_at_every_step_is_flagged(
    ranks: dict[int, list[float]], which: int, k: float
) -> None:
    slow = which % len(ranks)
    peak = [max(xs[i] for r, xs in ranks.items() if r != slow) for i in range(P.window)]
    ranks[slow] = [k * p for p in peak]
    v = run(ranks)[slow]
    assert v.kind == Kind.COMPUTE and v.value >= k - 1e-9


@given(runs(min_ranks=2), st.integers(0, 5), st.floats(min_value=0.0, max_value=1.29))
def test_a_rank_under_factor_times_its_fastest_peer_at_every_step_is_never_flagged_compute(
    ranks: dict[int, list[float]], which: int, k: float
) -> None:
    r0 = which % len(ranks)
    low = [min(xs[i] for r, xs in ranks.items() if r != r0) for i in range(P.window)]
    ranks[r0] = [k * x for x in low]
    v = run(ranks).get(r0)
    assert v is None or v.kind != Kind.COMPUTE


@given(st.integers(2, 8), window_steps)
def test_identical_ranks_flag_nothing(n: int, xs: list[float]) -> None:
    assert run(dict.fromkeys(range(n), xs)) == {}


@given(
    st.integers(2, 8),
    st.floats(min_value=0.01, max_value=1.0),
    st.lists(st.tuples(st.integers(0, P.window - 1), st.floats(min_value=1.0, max_value=1e6)), max_size=2),
)
def test_spikes_within_the_trimmed_fraction_flag_nothing(n: int, step_s: float, spikes: list) -> None:
    """Up to ``trim * window`` (2) steps of any length on one rank: a collection, a burst of
    another process on a shared machine."""
    ranks = dict.fromkeys(range(n), [step_s] * P.window)
    noisy = [step_s] * P.window
    for i, extra in spikes:
        noisy[i] += extra
    ranks[0] = noisy
    assert run(ranks) == {}


@given(runs(min_ranks=3), st.floats(min_value=1.2, max_value=1.29))
def test_a_flagged_rank_stays_flagged_down_to_clear_and_an_unflagged_one_is_not_flagged(
    ranks: dict[int, list[float]], k: float
) -> None:
    peers = {r: [1.0] * P.window for r in ranks}
    peers[0] = [k] * P.window
    held = run(peers, flagged={0: Verdict(0, Kind.COMPUTE, 1.5, 7, 7)})
    assert held[0].kind == Kind.COMPUTE and held[0].since_step == 7  # flagged since then, still
    assert run(peers) == {}  # the same score does not flag a rank that was not


def test_a_rank_back_under_clear_is_cleared() -> None:
    ranks = {0: [1.1] * 20, 1: [1.0] * 20, 2: [1.0] * 20}
    assert run(ranks, flagged={0: Verdict(0, Kind.COMPUTE, 1.5, 7, 7)}) == {}


def test_a_cpu_quota_throttling_one_step_in_three_is_flagged_not_trimmed_away() -> None:
    """A quota of 2/3 of a CPU in 100 ms periods on 30 ms steps: two steps at full speed, then one
    that waits out the period: the mean is 1.45x over these 20 steps, the median 1x; the trimmed
    mean (the two longest and shortest dropped) 1.375x."""
    quota = [0.03, 0.03, 0.075] * 7
    ranks = {0: quota[:20], 1: [0.03] * 20, 2: [0.03] * 20, 3: [0.03] * 20}
    v = run(ranks)[0]
    assert v.kind == Kind.COMPUTE and v.value == pytest.approx(1.375)


def test_network_slow_computes_like_its_peers_and_arrives_late() -> None:
    """Its peers wait 40 ms for it at the boundary every step, it waits 2 ms; its compute is theirs."""
    ranks = dict.fromkeys(range(4), [0.1] * 20)
    waits = {0: [0.002] * 20, 1: [0.042] * 20, 2: [0.042] * 20, 3: [0.042] * 20}
    v = run(ranks, waits)
    assert list(v) == [0] and v[0].kind == Kind.NETWORK and v[0].value == pytest.approx(1.4)
    assert "network" in v[0].describe("n3") and "on n3" in v[0].describe("n3")


def test_without_the_trainers_mark_a_late_rank_is_late_not_compute_or_network() -> None:
    ranks = {r: series([0.1] * 20, [0.002 if r == 0 else 0.042] * 20, marked=False) for r in range(4)}
    v = judge(ranks, {}, P)
    assert v[0].kind == Kind.LATE and "does not mark" in v[0].describe()
    slow = {r: series([0.15 if r == 0 else 0.1] * 20, marked=False) for r in range(4)}
    assert judge(slow, {}, P)[0].kind == Kind.LATE


def test_a_compute_straggler_is_compute_even_when_it_also_arrives_late() -> None:
    ranks = {0: [0.15] * 20, 1: [0.1] * 20, 2: [0.1] * 20}
    waits = {0: [0.0] * 20, 1: [0.02] * 20, 2: [0.02] * 20}
    assert run(ranks, waits)[0].kind == Kind.COMPUTE


def test_ranks_need_a_full_current_window() -> None:
    assert run({0: [0.2] * 19, 1: [0.1] * 19}) == {}  # one step short
    stale = {
        0: series([0.3] * 20, start=1),
        1: series([0.1] * 20, start=100),
        2: series([0.1] * 20, start=100),
    }
    assert judge(stale, {}, P) == {}  # rank 0's window ended 80 steps before the others'
    assert set(scores(stale, P)) == {1, 2}
    assert judge({0: series([0.5] * 20)}, {}, P) == {}  # no peer


def test_a_flag_is_kept_while_its_rank_cannot_be_judged_and_dropped_when_it_stops_reporting() -> None:
    v = Verdict(0, Kind.COMPUTE, 1.6, 40, 60)
    relaunched = {0: series([0.2] * 5), 1: series([0.1] * 5)}  # too few steps since a relaunch
    assert judge(relaunched, {0: v}, P) == {0: v}
    assert judge({1: series([0.1] * 20), 2: series([0.1] * 20)}, {0: v}, P) == {}


def test_factor_zero_flags_nothing() -> None:
    assert run({0: [1.0] * 20, 1: [0.1] * 20}, params=Params(factor=0)) == {}


def test_a_rank_is_flagged_once_it_scored_factor_in_hold_judgements_on_newer_windows() -> None:
    held = Params(hold=3)
    slow = {0: series([0.2] * 20), 1: series([0.1] * 20), 2: series([0.1] * 20)}
    v = judge(slow, {}, held)
    assert v[0].seen == 1 and stragglers(v, held) == {}
    assert judge(slow, v, held) == v, "the same window judged again is not seen again"
    later = {r: series([c[0].compute_s] * 20, start=11) for r, c in slow.items()}
    v = judge(later, v, held)
    assert v[0].seen == 2 and stragglers(v, held) == {}
    v = judge({r: series([c[0].compute_s] * 20, start=21) for r, c in slow.items()}, v, held)
    (flagged,) = stragglers(v, held).values()
    assert (flagged.rank, flagged.seen, flagged.since_step, flagged.step) == (0, 3, 20, 40)


def test_a_suspect_that_scores_under_factor_once_starts_again() -> None:
    held = Params(hold=2)
    burst = {0: series([0.2] * 20), 1: series([0.1] * 20), 2: series([0.1] * 20)}
    clean = {r: series([0.1] * 20, start=21) for r in range(3)}
    v = judge(clean, judge(burst, {}, held), held)
    assert v == {}, "one busy window is no straggler"
    again = {
        0: series([0.2] * 20, start=41),
        1: series([0.1] * 20, start=41),
        2: series([0.1] * 20, start=41),
    }
    assert judge(again, v, held)[0].seen == 1


def test_window_of_keeps_the_last_distinct_steps_and_the_last_record_of_a_step() -> None:
    ts = [StepTime(s, float(s), 0.0) for s in (1, 2, 3, 3, 4)]
    ts[3] = StepTime(3, 30.0, 0.0)
    assert [t.compute_s for t in window_of(ts, 3) or []] == [2.0, 30.0, 4.0]
    assert window_of(ts, 5) is None


def test_trimmed_mean_drops_the_trimmed_fraction_at_each_end() -> None:
    assert trimmed_mean([1.0] * 8 + [100.0, 0.0], 0.1) == 1.0
    assert trimmed_mean([2.0, 4.0], 0.1) == 3.0  # nothing to drop


# ---------------------------------------------------------------- the watch (node 0's judge)


def beat(rank: int, computes: Sequence[float], host: str = "h0", wall: float | None = None) -> Heartbeat:
    times = tuple(series(computes))
    return Heartbeat(
        rank, rank, host, 100 + rank, times[-1].step, Phase.TRAIN, wall or time.time(), step_times=times
    )


def watch(tmp_path: Path, node: int = 0, params: Params = P) -> tuple[StragglerWatch, list[dict[str, Any]]]:
    published: list[dict[str, Any]] = []
    log = EventLog(tmp_path, node, echo=None)
    # interval 0: every check judges (the loop's polls come a summary interval apart)
    return StragglerWatch(tmp_path, node, log, params, 0.0, lambda **kw: published.append(kw)), published


def test_the_watch_flags_a_slow_rank_once_publishes_it_and_clears_it(tmp_path: Path) -> None:
    w, published = watch(tmp_path)
    slow = [beat(0, [0.1] * 20), beat(1, [0.2] * 20), beat(2, [0.1] * 20)]
    w.check(slow)
    w.check(slow)  # still flagged: no second event, nothing new to publish
    (logged,) = [x.event for x in read_logged(events_path(tmp_path))]
    assert logged == ev.Straggler(rank=1, host="h0", kind="compute", value=2.0, since_step=20, step=20)
    (note,) = published[0]["stragglers"]
    assert (note.rank, note.kind, note.value) == (1, "compute", 2.0) and "2.00x" in note.text
    w.check([beat(r, [0.1] * 20) for r in range(3)])
    cleared = read_logged(events_path(tmp_path))[-1].event
    assert isinstance(cleared, ev.StragglerCleared) and cleared.rank == 1
    assert published[-1] == {"stragglers": ()}


def test_the_watch_reads_the_other_nodes_summaries_and_skips_stale_beats(tmp_path: Path) -> None:
    w, _ = watch(tmp_path)
    folder = tmp_path / "node1"
    for b in (beat(2, [0.1] * 20, "h1"), beat(3, [0.3] * 20, "h1")):
        write_heartbeat_in(folder, b)
    facts = NodeFacts(1, "h1", 99, 5.0, launch_id="L")
    clock = Clock(time.time())
    write_summary(tmp_path, *build_summary(read_heartbeat_folder(folder), facts, clock, PhaseTimeouts()))
    stale = beat(4, [5.0] * 20, wall=time.time() - 3600)  # its rank stopped reporting an hour ago
    w.check([beat(0, [0.1] * 20), beat(1, [0.1] * 20), stale])
    (logged,) = [x.event for x in read_logged(events_path(tmp_path))]
    assert isinstance(logged, ev.Straggler) and (logged.rank, logged.host) == (3, "h1")


@pytest.mark.parametrize(("node", "factor"), [(1, P.factor), (0, 0.0)])
def test_only_node_0_judges_and_factor_0_judges_nothing(tmp_path: Path, node: int, factor: float) -> None:
    w, published = watch(tmp_path, node, Params(factor=factor))
    w.check([beat(0, [0.1] * 20), beat(1, [1.0] * 20)])
    assert not read_logged(events_path(tmp_path, node)) and not published


def test_status_lists_the_stragglers_node_0_publishes(tmp_path: Path) -> None:
    w, published = watch(tmp_path)
    w.check([beat(0, [0.1] * 20), beat(1, [0.1] * 20), beat(2, [0.25] * 20)])
    facts = replace(NodeFacts(0, "h0", 99, 5.0, launch_id="L"), **published[-1])
    write_summary(tmp_path, *build_summary([], facts, Clock(time.time()), PhaseTimeouts()))
    r = build_report(tmp_path)
    assert r.stragglers == ("rank 2 on h0 computes 2.50x its peers' median, since step 20",)
    assert "stragglers:\n  rank 2 on h0 computes 2.50x" in render(r)
    assert json.loads(json.dumps(r.to_dict()))["stragglers"] == list(r.stragglers)
