"""`status --prometheus` and `watch --metrics-file`: a scrape parses with prometheus_client's own
parser, and says what `status --json` says (a run of the fake trainer under the watchdog, one
crash and a relaunch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from commands import REPO, supervisor_cmd
from prometheus_client.parser import text_string_to_metric_families
from watch_helpers import finish, start_watchdog

FAKE = str(REPO / "tests" / "fake_trainer.py")
FAST = ["--poll-interval", "0.1", "--kill-grace", "1", "--backoff-initial", "0.05", "--backoff-jitter", "0"]


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_status_prometheus_parses_and_matches_status_json(tmp_path: Path) -> None:
    root = tmp_path / "run"
    metrics = tmp_path / "textfile" / "run.prom"
    metrics.parent.mkdir()
    trainer = [
        sys.executable,
        FAKE,
        "--root",
        str(root),
        "--steps",
        "12",
        "--fault",
        "crash",
        "--fault-step",
        "7",
    ]
    watch = [*FAST, "--metrics-file", str(metrics), "--metrics-interval", "0.2"]
    rc, out = finish(start_watchdog(root, watch, trainer))
    assert rc == 0, out

    def status(*flags: str) -> str:
        p = subprocess.run(
            supervisor_cmd("status", "--ckpt-root", str(root), *flags),
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert p.returncode == 0, p.stderr
        return p.stdout

    doc = json.loads(status("--json"))
    scrape = status("--prometheus")
    got = samples(scrape)
    run = {"run": str(root)}
    assert got["resumable_run_state"] == [({**run, "state": "done"}, 1.0)]
    assert got["resumable_step"] == [(run, float(doc["current_step"]))] and doc["current_step"] == 12
    assert got["resumable_launches_total"] == [(run, 2.0)] and got["resumable_restarts_total"] == [(run, 1.0)]
    phases = {labels["phase"]: v for labels, v in got["resumable_last_recovery_seconds"]}
    assert phases == doc["nodes"][0]["recovery"] and "total" in phases
    newest = max(c["step"] for c in doc["checkpoints"] if c["valid"])
    assert got["resumable_checkpoint_step"] == [(run, float(newest))]
    assert got["resumable_checkpoint_age_seconds"][0][1] >= 0
    assert got["resumable_quarantined_checkpoints"] == [(run, 0.0)]
    assert got["resumable_ranks"] == [(run, 2.0)] and got["resumable_ranks_stale"] == [(run, 0.0)]
    # The watchdog's last write shows the final state, as a scrape of `status` does.
    kept = samples(metrics.read_text())
    assert kept["resumable_run_state"] == [({**run, "state": "done"}, 1.0)]
    assert kept["resumable_launches_total"] == got["resumable_launches_total"]
    assert oct(metrics.stat().st_mode & 0o777) == "0o644"


def test_a_run_without_anything_yet_leaves_values_out_instead_of_zero(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("")  # a run directory with nothing in it yet
    p = subprocess.run(
        supervisor_cmd("status", "--ckpt-root", str(tmp_path), "--prometheus"),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    got = samples(p.stdout)
    assert "resumable_step" not in got and "resumable_checkpoint_age_seconds" not in got
    assert got["resumable_launches_total"] == [({"run": str(tmp_path)}, 0.0)]


def test_the_grafana_dashboard_charts_metrics_that_exist() -> None:
    """docs/grafana-dashboard.json names only declared metrics, and charts every one."""
    import re

    from supervisor.prometheus import METRICS, PREFIX

    doc = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\bresumable_\w+", e)}
    assert named == {PREFIX + n for n in METRICS}, named ^ {PREFIX + n for n in METRICS}
