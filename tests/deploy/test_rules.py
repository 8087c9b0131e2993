"""Alert rules: promtool validates them and its unit tests fire each alert on bad series only."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
ALERTS = {"LayertapNonFinite", "LayertapActivationDrift", "LayertapChannelDrift",
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
    assert next(r for r in rules if r["alert"] == "LayertapActivationDrift")["for"] == "15m"


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
