"""deploy/k8s, checked with no cluster: each overlay renders (``kubectl kustomize``), every core
object validates against the Kubernetes schema (kubernetes-validate, strict), the Prometheus
Operator's and cert-manager's objects against their CRDs' (.ci/validate-crds.mjs), the rules pass
promtool, the generated files equal their sources, and the pods run what the image can serve.

Where kubectl, node or the CRD validators are missing, the test skips, except under CI=true,
where it fails naming what to install (kubectl comes with the machine image; ``bash .ci/setup
--test`` installs the validators).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_dockerfile import instructions

from layertap.server.cli.serve import build_parser, config_from_args
from layertap.server.config import check_exposure

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "tls")
#: The oldest Kubernetes the manifests target (native gRPC probes are GA in 1.27), and the newest
#: schema kubernetes-validate ships (1.37 with kubernetes-validate 1.37.0).
K8S_VERSIONS = ("1.27.0", "1.37.0")
CRD_GROUPS = ("monitoring.coreos.com", "cert-manager.io")
CRD_VALIDATOR = REPO / ".ci" / "validate-crds.mjs"
CRD_MODELS = REPO / ".ci" / "node_modules" / "@kubernetes-models"


def need(tool: str | None, what: str, how: str) -> None:
    """Skip without ``tool``; under CI (CI=true) fail instead, saying how to get it."""
    if tool is not None:
        return
    message = f"{what} is missing: {how}"
    if os.environ.get("CI"):
        pytest.fail(f"CI must check deploy/k8s, but {message}", pytrace=False)
    pytest.skip(message)


def kubectl() -> str:
    exe = shutil.which("kubectl")
    need(exe, "kubectl (renders deploy/k8s with `kubectl kustomize`)",
         "it comes with the machine image; install kubectl >= 1.27")
    assert exe is not None
    return exe


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    res = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"kubectl kustomize overlays/{overlay}:\n{res.stderr}"
    return tuple(d for d in yaml.safe_load_all(res.stdout) if d)


def render(overlay: str) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(d)) for d in _render(overlay)]  # a copy each test may change


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return c


def serve_args(docs: list[dict[str, Any]]) -> Any:
    """The command the pod runs, parsed as `layertap serve` parses it: the image's ENTRYPOINT, then args."""
    entry = json.loads(dict(instructions())["ENTRYPOINT"])
    assert entry[:2] == ["layertap", "serve"]
    return build_parser().parse_args([*entry[2:], *container(docs)["args"]])


def generator() -> Any:
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------- one source


def test_generated_files_equal_their_sources() -> None:
    gen = generator()
    for path, text in gen.generated().items():
        assert path.read_text(encoding="utf-8") == text, f"{path.relative_to(REPO)} is stale: run python deploy/k8s/generate.py"
    res = subprocess.run([sys.executable, str(K8S / "generate.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_prometheus_rule_and_dashboards_are_their_sources() -> None:
    gen = generator()
    rule = yaml.safe_load(gen.RULE_FILE.read_text())
    assert rule["spec"]["groups"] == yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
    cm = yaml.safe_load(gen.DASHBOARD_FILE.read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    sources = sorted((REPO / "deploy" / "grafana").glob("*.json"))
    assert sources and sorted(cm["data"]) == [p.name for p in sources]
    for p in sources:
        source, loaded = json.loads(p.read_text()), json.loads(cm["data"][p.name])
        # The one change: Grafana's datasource is a variable, not the compose stack's uid.
        assert loaded["templating"]["list"][0]["type"] == "datasource"
        assert "layertap-prometheus" not in cm["data"][p.name]
        assert loaded["panels"] == json.loads(json.dumps(source["panels"]).replace('"layertap-prometheus"', '"${datasource}"'))
        assert loaded["templating"]["list"][1:] == json.loads(
            json.dumps(source["templating"]["list"]).replace('"layertap-prometheus"', '"${datasource}"'))


def test_a_changed_source_makes_the_check_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = generator()
    alerts = tmp_path / "alerts.yml"
    alerts.write_text(gen.ALERTS.read_text().replace("for: 15m", "for: 16m", 1))
    monkeypatch.setattr(gen, "ALERTS", alerts)
    assert gen.stale() == [gen.RULE_FILE]


# ---------------------------------------------------------------------------- rendering and schemas


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_the_whole_deployment(overlay: str) -> None:
    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    want = ["ConfigMap", "Namespace", "NetworkPolicy", "PodDisruptionBudget", "PrometheusRule", "Service", "Service",
            "ServiceMonitor", "StatefulSet"]
    if overlay == "tls":
        want += ["Certificate", "Certificate", "Issuer", "Issuer"]
    assert kinds == sorted(want)
    namespaced = [d for d in docs if d["kind"] != "Namespace"]
    assert {d["metadata"]["namespace"] for d in namespaced} == {one(docs, "Namespace")["metadata"]["name"]}


def schemas() -> Any:
    """kubernetes-validate (the [dev] extra), which ships the Kubernetes schemas."""
    found = importlib.util.find_spec("kubernetes_validate")
    need(None if found is None else "kubernetes_validate", "kubernetes-validate",
         "pip install -c constraints-ci.txt -e '.[dev]'")
    return importlib.import_module("kubernetes_validate")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_objects_validate_against_the_kubernetes_schema(overlay: str) -> None:
    kubernetes_validate = schemas()
    core = [d for d in render(overlay) if d["apiVersion"].split("/")[0] not in CRD_GROUPS]
    assert len(core) >= 7
    for doc in core:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"overlays/{overlay}: {doc['kind']} {doc['metadata']['name']} on Kubernetes {version}: "
                            f"{exc.message} at {'/'.join(map(str, exc.path))}")


def test_the_kubernetes_schema_check_catches_a_misspelt_field() -> None:
    kubernetes_validate = schemas()
    sts = one(render("cpu"), "StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[0], strict=True)


def validate_crds(objects: list[dict[str, Any]]) -> list[dict[str, str]]:
    node = shutil.which("node")
    need(node, "node (runs .ci/validate-crds.mjs)", "install Node.js")
    need(str(CRD_MODELS) if (CRD_MODELS / "cert-manager").is_dir() and (CRD_MODELS / "prometheus-operator").is_dir()
         else None, "the CRD validators (@kubernetes-models/prometheus-operator, @kubernetes-models/cert-manager)",
         "run bash .ci/setup --test")
    assert node is not None
    res = subprocess.run([node, str(CRD_VALIDATOR)], input=json.dumps(objects), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    results: list[dict[str, str]] = json.loads(res.stdout)
    return results


def test_custom_resources_validate_against_their_crds() -> None:
    objects = [d for o in OVERLAYS for d in render(o) if d["apiVersion"].split("/")[0] in CRD_GROUPS]
    assert {d["kind"] for d in objects} == {"ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"}
    bad = [r for r in validate_crds(objects) if r["error"]]
    assert bad == []


def test_the_crd_check_catches_a_wrong_type_and_a_misspelt_field() -> None:
    monitor = one(render("cpu"), "ServiceMonitor")
    wrong = json.loads(json.dumps(monitor))
    wrong["spec"]["endpoints"][0]["port"] = 9466  # a port name is a string
    misspelt = json.loads(json.dumps(monitor))
    misspelt["spec"]["endpoints"][0]["tlsconfig"] = misspelt["spec"]["endpoints"][0].pop("tlsConfig")
    results = validate_crds([wrong, misspelt])
    assert "port must be string" in results[0]["error"]
    assert "unknown field(s): data/spec/endpoints/0/tlsconfig" in results[1]["error"]


def test_rules_in_the_prometheus_rule_pass_promtool(tmp_path: Path) -> None:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not on PATH (CI installs Debian's prometheus package)")
    rule = one(render("cpu"), "PrometheusRule")
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    res = subprocess.run([exe, "check", "rules", "alerts.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # deploy/prometheus's unit tests, run against the rendered rules.
    shutil.copy(REPO / "deploy" / "prometheus" / "alerts_test.yml", tmp_path / "alerts_test.yml")
    res = subprocess.run([exe, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------- what the pods run


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pods_serve_with_auth_tls_and_a_reachable_health_listener(overlay: str) -> None:
    docs = render(overlay)
    args = serve_args(docs)
    # The image binds the health listener to loopback, which the kubelet cannot reach.
    assert args.health_address == "0.0.0.0:50052"
    assert check_exposure(config_from_args(args)) is None  # protected mode lets it start: tokens and TLS
    assert args.host == "0.0.0.0" and not args.insecure
    assert args.device == ("cuda" if overlay == "gpu" else "cpu")
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port, "health": int(args.health_address.split(":")[1])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": ports["health"]}, probe  # native gRPC probes, Health only
    # Files the flags name come from the volumes mounted there.
    spec = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for flag, secret, key in ((args.auth_tokens, "layertap-auth", "tokens"), (args.tls_cert, "layertap-tls", "tls.crt"),
                              (args.tls_key, "layertap-tls", "tls.key")):
        folder, _, file = flag.rpartition("/")
        source = volumes[mounts[folder]]["secret"]
        assert source["secretName"] == secret and {"key": key, "path": file} in source["items"], flag


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_hardened(overlay: str) -> None:
    docs = render(overlay)
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}
    # What the server writes lands on volumes: /tmp, the inductor cache (the compiled reducers), the claim.
    env = {e["name"]: e["value"] for e in c["env"]}
    image_env = [rest for word, rest in instructions() if word == "ENV" and rest.startswith("TORCHINDUCTOR_CACHE_DIR=")]
    assert image_env == [f"TORCHINDUCTOR_CACHE_DIR={env['TORCHINDUCTOR_CACHE_DIR']}"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/tmp", env["TORCHINDUCTOR_CACHE_DIR"]):
        assert "emptyDir" in volumes[mounts[path]], path
    writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    for name, value in env.items():  # every cache a library writes sits on a volume, never on the read-only root
        if value.startswith("/"):
            assert any(value == w or value.startswith(w + "/") for w in writable), (name, value)
    assert {"TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "HF_HOME"} <= set(env)
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    if overlay == "gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-cuda")
    else:
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
    # The restricted Pod Security Standard admits these pods.
    assert one(docs, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_baselines_and_incidents_live_on_each_replicas_own_claim() -> None:
    docs = render("cpu")
    sts = one(docs, "StatefulSet")
    args = serve_args(docs)
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in container(docs)["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    for folder in (args.baseline_dir, args.incident_dir):
        assert folder.startswith(mount["mountPath"] + "/"), folder
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # one per pod: why a StatefulSet
    # Upgrades and scale-downs keep every replica's baselines.
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    grace = float(args.grace_seconds)
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace + 20  # + the watchdog's margin


def test_services_discovery_and_disruptions_select_the_pods() -> None:
    docs = render("cpu")
    sts = one(docs, "StatefulSet")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selects(sts["spec"]["selector"]["matchLabels"], pod_labels)
    service, headless = one(docs, "Service", "layertap"), one(docs, "Service", "layertap-headless")
    for svc in (service, headless):
        assert selects(svc["spec"]["selector"], pod_labels)
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "layertap-headless"
    assert {p["name"] for p in headless["spec"]["ports"]} == {"grpc"}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}
    pdb = one(docs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels) and pdb["spec"]["maxUnavailable"] == 1
    policy = one(docs, "NetworkPolicy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels) and policy["spec"]["policyTypes"] == ["Ingress"]
    allowed = {(r["ports"][0]["port"], tuple(sorted(r["from"][0]["podSelector"]["matchLabels"].items())))
               for r in policy["spec"]["ingress"]}
    assert allowed == {("metrics", (("app.kubernetes.io/name", "prometheus"),)), ("grpc", (("layertap.dev/client", "true"),))}


def test_the_service_monitor_scrapes_each_replica_once_over_https_with_a_token() -> None:
    docs = render("cpu")
    monitor = one(docs, "ServiceMonitor")
    selected = [d for d in docs if d["kind"] == "Service"
                and selects(monitor["spec"]["selector"]["matchLabels"], d["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in selected] == ["layertap"]  # not the headless one too
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert endpoint["scheme"] == "https"
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "layertap-scrape", "key": "token"}}
    assert endpoint["tlsConfig"]["ca"] == {"secret": {"name": "layertap-tls", "key": "ca.crt"}}
    # instance = the pod's name: what the alerts and the dashboard's Replicas row name.
    assert {"action": "replace", "sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"} in \
        endpoint["relabelings"]


def test_cert_manager_issues_the_secret_the_pods_and_prometheus_read() -> None:
    docs = render("tls")
    namespace = one(docs, "Namespace")["metadata"]["name"]
    cert = one(docs, "Certificate", "layertap")
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    tls_volume = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert cert["spec"]["secretName"] == tls_volume["secret"]["secretName"] == "layertap-tls"
    names = set(cert["spec"]["dnsNames"])
    for svc in (d for d in docs if d["kind"] == "Service"):
        name = svc["metadata"]["name"]
        assert {name, f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"} <= names, name
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["tlsConfig"]["serverName"] in names
    assert "server auth" in cert["spec"]["usages"]
    # The issuer chain resolves inside the overlay: self-signed -> CA certificate -> CA issuer -> server.
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    ca_issuer = issuers[cert["spec"]["issuerRef"]["name"]]
    ca_cert = next(d for d in docs if d["kind"] == "Certificate" and d["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"])
    assert ca_cert["spec"]["isCA"] and "selfSigned" in issuers[ca_cert["spec"]["issuerRef"]["name"]]["spec"]


def test_fleet_targets_in_the_docs_name_the_headless_service() -> None:
    docs = render("cpu")
    namespace = one(docs, "Namespace")["metadata"]["name"]
    port = next(p["port"] for p in one(docs, "Service", "layertap-headless")["spec"]["ports"] if p["name"] == "grpc")
    target = f"dns:///layertap-headless.{namespace}.svc.cluster.local:{port}"
    assert target in (REPO / "docs" / "kubernetes.md").read_text()
