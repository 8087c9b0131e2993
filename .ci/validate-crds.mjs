// Validates custom resources against their CRDs' OpenAPI schemas, as compiled
// by @kubernetes-models/prometheus-operator and @kubernetes-models/cert-manager
// (installed here by .ci/setup --test; MIT). Reads a JSON array of objects on
// stdin; prints a JSON array of {kind, name, error}, error "" when valid.
// Used by tests/deploy/test_k8s.py. Lives in .ci/ so that node finds
// .ci/node_modules.
//
// CRD schemas let unknown fields through (the API server prunes them
// silently), so a misspelt field would pass: a field name that no compiled
// schema of these packages reads is reported too. Free-form maps (labels,
// annotations, matchLabels) are not checked.
import { readFileSync, readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import { Certificate } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate";
import { Issuer } from "@kubernetes-models/cert-manager/cert-manager.io/v1/Issuer";
import { ClusterIssuer } from "@kubernetes-models/cert-manager/cert-manager.io/v1/ClusterIssuer";

const models = [ServiceMonitor, PrometheusRule, Certificate, Issuer, ClusterIssuer];

const here = dirname(fileURLToPath(import.meta.url));
const known = new Set();
for (const pkg of ["prometheus-operator", "cert-manager", "apimachinery"]) {
  const dir = join(here, "node_modules", "@kubernetes-models", pkg, "_schemas");
  for (const file of readdirSync(dir)) {
    for (const m of readFileSync(join(dir, file), "utf8").matchAll(/data\.([A-Za-z_$][\w$]*)|data\["([^"]+)"\]/g)) {
      known.add(m[1] ?? m[2]);
    }
  }
}
const FREE = new Set(["labels", "annotations", "matchLabels"]);

function unknownFields(node, path, out) {
  if (Array.isArray(node)) {
    node.forEach((v, i) => unknownFields(v, `${path}/${i}`, out));
  } else if (node && typeof node === "object") {
    for (const [key, value] of Object.entries(node)) {
      if (!known.has(key)) out.push(`${path}/${key}`);
      if (!FREE.has(key)) unknownFields(value, `${path}/${key}`, out);
    }
  }
  return out;
}

const objects = JSON.parse(readFileSync(0, "utf8"));
const results = objects.map((obj) => {
  const model = models.find((m) => m.is(obj));
  let error = "";
  if (!model) {
    error = `no CRD schema here for ${obj.apiVersion} ${obj.kind}`;
  } else {
    try {
      new model(obj).validate();
    } catch (e) {
      error = String(e.message || e);
    }
    const unknown = unknownFields(obj, "data", []);
    if (unknown.length) error += `${error ? "; " : ""}unknown field(s): ${unknown.join(", ")}`;
  }
  return { kind: obj.kind, name: obj.metadata?.name ?? "", error };
});
process.stdout.write(JSON.stringify(results) + "\n");
