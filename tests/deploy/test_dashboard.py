"""The Grafana dashboard and the compose stack, checked statically (no Docker engine here)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.dashboard import DASHBOARD, dashboard_exprs, dashboard_targets, dashboard_variables, load_dashboard

pytestmark = pytest.mark.unit

DEPLOY = DASHBOARD.parents[1]
VALUES = {"model": "demo", "layer": "layer3", "phase": "decode", "tap": "baseline-0123abcd"}


def test_dashboard_has_the_required_panels_and_variables() -> None:
    d = load_dashboard()
    assert d["uid"] == "layertap-drift"
    # phase: one at a time (each phase has its own edges and baseline); tap: the heatmap sums buckets of one tap's edges
    assert dashboard_variables() == ["model", "layer", "phase", "tap"]
    panels = {(p["type"], p["title"]) for p in d["panels"]}
    types = {t for t, _ in panels}
    assert {"stat", "status-history", "heatmap", "timeseries"} <= types
    titles = " | ".join(t for _, t in panels).lower()
    for word in ("layers drifting", "mean ± std", "activation values", "nan / inf", "hook overhead",
                 "inference latency", "stream drops", "staleness"):
        assert word in titles, word
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_every_target_is_non_empty_and_without_fallbacks() -> None:
    targets = dashboard_targets()
    assert len(targets) >= 10
    for title, expr in targets:
        assert expr.strip(), title
        assert "orvector(" not in expr.replace(" ", ""), title  # no fallbacks that hide missing series
    exprs = dashboard_exprs(values=VALUES)
    assert not any("$" in e for e in exprs)
    latency = [e for e in exprs if "layertap_inference_duration_seconds_bucket" in e]
    assert any("histogram_quantile(0.5," in e for e in latency) and any("histogram_quantile(0.99," in e for e in latency)


def test_activation_queries_keep_the_layer_label() -> None:
    # The e2e test checks results carry `layer`; no aggregation may drop it.
    for expr in dashboard_exprs(values=VALUES):
        if "layertap_activation_" in expr and " by (" in expr:
            for clause in expr.split(" by (")[1:]:
                assert "layer" in clause.split(")")[0], expr


def test_per_layer_panels_show_one_phase_and_overviews_cover_all() -> None:
    """A decode step's scores and an Infer pass's are separate series: the per-layer panels pick
    one phase, the overviews keep every phase apart or take the worst (never mix their buckets)."""
    phase_var = next(v for v in load_dashboard()["templating"]["list"] if v["name"] == "phase")
    assert not phase_var["multi"] and not phase_var["includeAll"]  # the heatmap must not sum two phases' edges
    for title, expr in dashboard_targets():
        if "layertap_activation_" not in expr:
            continue
        if "$layer" in expr:
            assert expr.count('phase=~"$phase"') == expr.count("layertap_activation_"), (title, expr)
        elif " by (" in expr and "max by" not in expr:  # sums over layers keep the phases apart
            assert all("phase" in c.split(")")[0] for c in expr.split(" by (")[1:]), (title, expr)
    staleness = [e for t, e in dashboard_targets() if "last_update" in e]
    assert staleness and all("max without (phase)" in e for e in staleness)  # as the alert: the newest phase


def test_exprs_are_valid_promql(tmp_path: Path) -> None:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not on PATH")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(dashboard_exprs(values=VALUES))
    ]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    res = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_stack_is_consistent() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    svc = compose["services"]
    assert set(svc) == {"layertap", "prometheus", "grafana"}
    # Compose appends `command` to the image's ENTRYPOINT: what the container runs is both, and
    # it must parse as `layertap serve` parses it (a repeated `layertap serve` made it exit 2).
    from test_dockerfile import instructions

    from layertap.server.cli.serve import build_parser

    entry = json.loads(dict(instructions())["ENTRYPOINT"])
    argv = [*entry, *svc["layertap"]["command"]]
    assert argv[:2] == ["layertap", "serve"]
    args = build_parser().parse_args(argv[2:])
    assert args.host == "0.0.0.0" and args.metrics_port == 9466 and args.port == 50051
    assert args.insecure  # explicit: local use only (protected mode refuses 0.0.0.0 otherwise)
    assert args.baseline_dir == svc["layertap"]["volumes"][0].split(":")[1]  # on the named volume
    # which starts as a copy of the image's directory: it must exist there, owned by the server's user
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert f"mkdir -p {args.baseline_dir}" in runs and f"chown layertap {args.baseline_dir}" in runs
    for service in svc.values():  # published on loopback only
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:") and str(port).count(":") == 2, port
    env = svc["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")  # from the environment
    assert "admin" not in env["GF_SECURITY_ADMIN_PASSWORD"].split("${")[0]
    assert (DEPLOY / svc["layertap"]["build"]["context"]).resolve() == DEPLOY.parent  # the repo root
    for service in ("prometheus", "grafana"):
        for vol in svc[service]["volumes"]:
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), vol
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["layertap:9466"]
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert all(p["datasource"]["uid"] == uid for p in load_dashboard()["panels"])
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "layertap.yml").read_text())
    mounted = [v for v in svc["grafana"]["volumes"] if "layertap-drift.json" in v][0]
    assert mounted.split(":")[1].startswith(prov["providers"][0]["options"]["path"])


def test_a_fleet_is_shown_aggregated_and_per_replica() -> None:
    """Each replica is a scrape target (instance; deploy/k8s sets it to the pod's name): the overview
    panels aggregate every replica, the Replicas row shows each one, legends tell replicas apart."""
    d = load_dashboard()
    targets = dashboard_targets()
    by_title: dict[str, list[str]] = {}
    for title, expr in targets:
        by_title.setdefault(title, []).append(expr)
    for title in ("Layers drifting", "Drift by layer (worst score / threshold)", "Inference latency",
                  "Activation values — $layer ($phase)", "Replicas serving"):
        assert by_title[title] and all("by (instance" not in e for e in by_title[title]), title  # across replicas
    (count,) = by_title["Replicas drifting, per layer"]  # replicas counted per layer, each once whatever its phases
    assert count.startswith("sum by (layer) (max by (instance, layer) (")
    per_replica = {t for t, e in targets if "by (instance" in e}
    assert {"Drift by replica and layer (worst score / threshold)", "Mean — $layer ($phase), per replica",
            "Inference per replica"} <= per_replica
    row = next(p for p in d["panels"] if p["type"] == "row")
    assert row["title"] == "Replicas" and all(
        p["gridPos"]["y"] > row["gridPos"]["y"] for p in d["panels"] if p["title"] in per_replica)
    # A panel that shows raw per-series values names the replica in its legend.
    for p in d["panels"]:
        for t in p.get("targets", []):
            if "by (" not in t["expr"] and "layertap_activation_" in t["expr"] and "time()" not in t["expr"]:
                assert "{{instance}}" in t["legendFormat"], (p["title"], t["expr"])
