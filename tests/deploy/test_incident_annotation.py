"""The dashboard marks flight-recorder incidents on its time axis."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.dashboard import load_dashboard

pytestmark = pytest.mark.unit


def _note() -> dict:
    (note,) = [a for a in load_dashboard()["annotations"]["list"] if a["name"] == "Incidents"]
    return note


def test_incident_annotation_queries_the_incident_counter() -> None:
    note = _note()
    assert note["enable"] and note["datasource"]["uid"] == "layertap-prometheus"
    assert note["expr"].startswith("increase(layertap_incidents_total{") and 'model="$model"' in note["expr"]
    assert set(note["tagKeys"].split(",")) == {"tap", "trigger"}


def test_the_first_incident_of_a_tap_is_marked(tmp_path: Path) -> None:
    """layertap_incidents_total{tap,trigger} is born at 1 by its first incident, which
    increase() alone never counts; the annotation's query marks it, and later ones."""
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not on PATH (CI installs Debian's prometheus package)")
    expr = _note()["expr"].replace("$model", "m")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "annotation", "rules": [
        {"alert": "Incident", "expr": expr}]}]}))
    labels = {"model": "m", "tap": "g", "trigger": "nan"}
    series = 'layertap_incidents_total{model="m",tap="g",trigger="nan"}'
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [{"series": series, "values": "_ _ _ 1 1 1 1 2 2 2"}],
                   "alert_rule_test": [
                       {"eval_time": "2m", "alertname": "Incident", "exp_alerts": []},
                       {"eval_time": "3m", "alertname": "Incident", "exp_alerts": [{"exp_labels": labels}]},
                       {"eval_time": "5m", "alertname": "Incident", "exp_alerts": []},
                       {"eval_time": "7m", "alertname": "Incident", "exp_alerts": [{"exp_labels": labels}]},
                   ]},
                  # Scrapes missed for minutes (Prometheus or the target away): an old count is no incident.
                  {"interval": "1m", "input_series": [{"series": series, "values": "2x20 _x12 2x15"}],
                   "alert_rule_test": [
                       {"eval_time": f"{m}m", "alertname": "Incident", "exp_alerts": []} for m in (33, 34, 36)]}]}))
    res = subprocess.run([exe, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
