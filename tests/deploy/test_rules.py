"""Alert rules: promtool validates them and its unit tests fire each alert on bad series only."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
#: LayertapChannelDrift is gone (issue 26): the calibrated alarm tests every feature itself.
ALERTS = {"LayertapNonFinite", "LayertapActivationDrift",
          "LayertapTelemetryStale", "LayertapStreamDrops", "LayertapHookOverheadHigh"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not on PATH (CI installs Debian's prometheus package)")
    return subprocess.run([exe, *args], cwd=PROM, capture_output=True, text=True, timeout=60)


def test_alerts_exist_with_severity() -> None:
    rules = [r for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    sev = {r["alert"]: r["labels"]["severity"] for r in rules}
    assert sev["LayertapNonFinite"] == "critical"
    drift = next(r for r in rules if r["alert"] == "LayertapActivationDrift")
    # The server's calibrated alarm, decided once per window: no `for` delays it further.
    assert drift["expr"] == "layertap_activation_drift_alarm == 1" and "for" not in drift


def test_every_alert_has_a_unit_test() -> None:
    doc = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    fired = {t["alertname"] for case in doc["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == ALERTS


def test_phase_labelled_alerts_are_tested_for_decode() -> None:
    """Each activation alert's test series carry a phase, and a decode-phase drift and NaN alert fire."""
    doc = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    for case in doc["tests"]:
        for series in case["input_series"]:
            if series["series"].startswith("layertap_activation_"):
                assert 'phase="' in series["series"], series
    fired = {(t["alertname"], a["exp_labels"].get("phase")) for case in doc["tests"] for t in case["alert_rule_test"]
             for a in t["exp_alerts"]}
    assert {("LayertapActivationDrift", "decode"), ("LayertapNonFinite", "decode")} <= fired


def test_promtool_check_rules() -> None:
    res = promtool("check", "rules", "alerts.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_test_rules() -> None:
    res = promtool("test", "rules", "alerts_test.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_prometheus_config() -> None:
    res = promtool("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_fleet_alerts_fire_per_replica_and_name_it() -> None:
    """A replica is a scrape target (instance): the drift alert fires for the one that drifted,
    its summary names it, and a test case covers two replicas of which only one fires."""
    rules = {r["alert"]: r for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    for name in ("LayertapActivationDrift", "LayertapNonFinite", "LayertapTelemetryStale"):
        assert "{{ with $labels.instance }} on {{ . }}{{ end }}" in rules[name]["annotations"]["summary"], name
        assert "instance" not in rules[name]["expr"]  # never aggregated away: each replica alerts on its own
    doc = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    fleet = [case for case in doc["tests"]
             if len({s["series"].split('instance="')[1].split('"')[0] for s in case["input_series"]
                     if 'instance="' in s["series"]}) >= 2]
    fired = [(t["alertname"], a) for case in fleet for t in case["alert_rule_test"] for a in t["exp_alerts"]]
    drift = [a for name, a in fired if name == "LayertapActivationDrift"]
    assert len(drift) == 1 and f" on {drift[0]['exp_labels']['instance']} " in drift[0]["exp_annotations"]["summary"]
