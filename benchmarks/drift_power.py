"""Drift alarm power and false alarms through the public API (issue 26).

    python benchmarks/drift_power.py [--calm-windows 100] [--out DIR] [--alibi-python /work/venv-alibi/bin/python]

A server hosts the demo model (in process, reached over gRPC by ``layertap.Client``
only). A baseline of ``--passes`` (500) live passes of N(0, 1) inputs (batch 8) freezes
over layer1-4 with window 50. Then:

* ``--calm-windows`` in-distribution windows: the calibrated alarm's false alarms (an
  alarm raised in a window stays up until a clean window completes, so one read per
  window sees each), and the fixed-threshold rule Evidently ships by default (normed
  Wasserstein > 0.1, here on the server's pooled histogram of the layer);
* for each input shift (mean +0.05σ, +0.1σ, +0.2σ; scale × 1.05, × 1.1): clean windows
  until no alarm is up, then one shifted window with a read after every pass: the layers flagged
  within the window, and the passes to detection (counted here from the shift's first
  pass, and as the server reports it).

With ``--out`` the same windows are written as ``.npy`` files of per-pass features
(each pass's per-channel means of the layer, from the same demo model rebuilt here
from its seed on the same inputs), and with ``--alibi-python`` the interpreter of a
venv with alibi-detect 0.13 (numpy<2) scores them with its MMD drift detector
(``benchmarks/_drift_alibi.py``, p = 0.05), side by side.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import layertap
from layertap.server.app import start_server
from layertap.server.config import ServerConfig
from layertap.server.host.demo_model import build_demo_model

LAYERS = ["layer1", "layer2", "layer3", "layer4"]
SHIFTS = [("+0.05σ", 0.05, 1.0), ("+0.1σ", 0.1, 1.0), ("+0.2σ", 0.2, 1.0), ("×1.05", 0.0, 1.05), ("×1.1", 0.0, 1.1)]
EVIDENTLY_W1 = 0.1


class Traffic:
    """Sends batches through Infer and computes the same passes' per-channel means locally (for the .npy files)."""

    def __init__(self, client: layertap.Client, srv: Any, batch: int, seed: int) -> None:
        self.client, self.srv, self.batch = client, srv, batch
        self.rng = np.random.default_rng(seed)
        self.model = build_demo_model(0).eval()
        self._feat: dict[str, np.ndarray] = {}
        for name in LAYERS:
            getattr(self.model, name).register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(_m: Any, _i: Any, out: torch.Tensor) -> None:
            self._feat[name] = out.double().mean(dim=(0, 2, 3)).numpy()
        return hook

    def passes(self, n: int, shift: float = 0.0, scale: float = 1.0, each: Any = None) -> dict[str, np.ndarray]:
        rows: dict[str, list[np.ndarray]] = {name: [] for name in LAYERS}
        for i in range(n):
            x = (self.rng.standard_normal((self.batch, 3, 32, 32)) * scale + shift).astype(np.float32)
            self.client.infer(x)
            with torch.no_grad():
                self.model(torch.from_numpy(x))
            for name in LAYERS:
                rows[name].append(self._feat[name])
            if each is not None:
                assert self.srv.state.taps.flush(20)
                each(i + 1)
        assert self.srv.state.taps.flush(20), "tap pipeline did not drain"
        return {name: np.stack(r) for name, r in rows.items()}


def drift(client: layertap.Client) -> dict[str, Any]:
    return {d.layer: d for d in client.drift()}


def cost(calls: int, batch: int, passes: int, window: int) -> None:
    """Per-pass cost of a baseline tap, the calibrated alarm against fixed thresholds, interleaved in one run.

    Three in-process servers, the same demo model: no tap, a frozen baseline over layer1-4
    with fixed thresholds (the scoring path as it was before calibration: same reducers,
    no alarm), and the same baseline calibrated. Calls rotate among them, so the shared
    cores' load falls on all three alike; the statistic is the median Infer wall time.
    """
    srvs = [start_server(ServerConfig(port=0, metrics_port=None, compile_reducers=False), None) for _ in range(3)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    try:
        clients = [layertap.Client(f"127.0.0.1:{s.port}") for s in srvs]
        clients[1].set_baseline("layer*", passes=passes, window=window, thresholds={"psi": 0.2})
        clients[2].set_baseline("layer*", passes=passes, window=window)
        for _ in range(passes):
            for c in clients:
                c.infer(x)
        for s in srvs:
            assert s.state.taps.flush(20)
        assert [d.calibration for d in clients[1].drift()] == ["fixed"] * 4
        assert [d.calibration for d in clients[2].drift()] == ["calibrated"] * 4
        times: list[list[float]] = [[], [], []]
        for i in range(calls):
            for j in ((0, 1, 2), (1, 2, 0), (2, 0, 1))[i % 3]:
                t = time.perf_counter()
                clients[j].infer(x)
                times[j].append(time.perf_counter() - t)
        for s in srvs:
            assert s.state.taps.flush(20)
        med = [float(np.median(t)) * 1e3 for t in times]
        print(f"per-pass Infer, batch {batch}, {calls} calls each, interleaved: untapped {med[0]:.2f} ms, "
              f"baseline tap with fixed thresholds {med[1]:.2f} ms, calibrated {med[2]:.2f} ms")
        print(f"  calibrated / fixed = {med[2] / med[1]:.3f}x; tap cost over untapped: fixed +{med[1] - med[0]:.2f} ms, "
              f"calibrated +{med[2] - med[0]:.2f} ms")
        for c in clients:
            c.close()
    finally:
        for s in srvs:
            s.stop(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=500)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--calm-windows", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="directory for the windows' .npy files (default: a temporary one)")
    p.add_argument("--alibi-python", help="python of a venv with alibi-detect 0.13: score the same windows with MMD")
    p.add_argument("--cost", type=int, default=0, metavar="CALLS",
                   help="only measure a baseline tap's per-pass cost, calibrated against fixed, with CALLS calls each")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cost:
        cost(args.cost, args.batch, args.passes, args.window)
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="drift-power-"))
    out.mkdir(parents=True, exist_ok=True)
    w = args.window
    srv = start_server(ServerConfig(port=0, metrics_port=None, compile_reducers=False), None)
    t0 = time.monotonic()
    try:
        with layertap.Client(f"127.0.0.1:{srv.port}") as client:
            traffic = Traffic(client, srv, args.batch, args.seed)
            client.set_baseline("layer*", passes=args.passes, window=w)
            base = traffic.passes(args.passes)
            # Under full CPU load the telemetry threads (nice 19) fall behind and drop passes,
            # counted: then the baseline needs a few more to freeze.
            while not all(d.state == "ready" for d in drift(client).values()):
                more = traffic.passes(10)
                base = {n: np.concatenate((base[n], more[n])) for n in LAYERS}
            for name in LAYERS:
                np.save(out / f"base_{name}.npy", base[name])
            frozen = drift(client)
            print(f"baseline: {args.passes} passes of N(0, 1), batch {args.batch}, window {w}; "
                  + ", ".join(f"{n} {frozen[n].calibration} thr {frozen[n].threshold:.2f}" for n in LAYERS))

            calm: dict[str, list[np.ndarray]] = {name: [] for name in LAYERS}
            false_alarms = {name: 0 for name in LAYERS}
            fixed_alarms = {name: 0 for name in LAYERS}
            max_ratio = dict.fromkeys(LAYERS, 0.0)
            raised = dict.fromkeys(LAYERS, 0)
            for _ in range(args.calm_windows):
                feats = traffic.passes(w)
                d = drift(client)
                for name in LAYERS:
                    calm[name].append(feats[name])
                    # A new alarm has a new alarm_pass (passes dropped under load shift the server's
                    # windows against these chunks of 50; each alarm still counts once).
                    if d[name].alarm and d[name].alarm_pass != raised[name]:
                        false_alarms[name] += 1
                        raised[name] = d[name].alarm_pass
                    fixed_alarms[name] += int(d[name].wasserstein > EVIDENTLY_W1)
                    max_ratio[name] = max(max_ratio[name], d[name].ratio)
            for name in LAYERS:
                np.save(out / f"calm_{name}.npy", np.stack(calm[name]))
            layer_windows = sum(d.windows for d in drift(client).values())
            print(f"\nin distribution, {args.calm_windows} windows x {len(LAYERS)} layers sent; the server "
                  f"completed {layer_windows} layer-windows ({sum(d.ignored_passes for d in drift(client).values())} "
                  "passes left out)")
            print(f"  calibrated alarm: {sum(false_alarms.values())} false alarms "
                  f"(largest score/threshold {max(max_ratio.values()):.2f})  {false_alarms}")
            print(f"  fixed W1 > {EVIDENTLY_W1} (Evidently's default): {sum(fixed_alarms.values())} false alarms")

            rows = []
            for label, shift, scale in SHIFTS:
                # Clean windows first, until the previous shift's alarm clears: a CUSUM still
                # carries that shift's evidence for a while, and may fire once more early on.
                for clear_windows in range(1, 4):
                    traffic.passes(w)
                    clean = drift(client)
                    if not any(c.alarm for c in clean.values()):
                        break
                first: dict[str, int] = {}

                def seen(i: int) -> None:
                    for n, d in drift(client).items():
                        if d.alarm and n not in first:
                            first[n] = i

                feats = traffic.passes(w, shift, scale, each=seen)
                for name in LAYERS:
                    np.save(out / f"shift_{label}_{name}.npy", feats[name])
                d = drift(client)
                rows.append({"shift": label, "cleared": not any(c.alarm for c in clean.values()),
                             "clean_windows": clear_windows,
                             "flagged": [n for n in LAYERS if n in first],
                             "passes_to_detection": {n: first.get(n) for n in LAYERS},
                             "server_detection_passes": {n: d[n].detection_passes for n in LAYERS},
                             "ratio": {n: round(d[n].ratio, 1) for n in LAYERS},
                             "w1": {n: round(d[n].wasserstein, 3) for n in LAYERS},
                             "fixed_flagged": [n for n in LAYERS if d[n].wasserstein > EVIDENTLY_W1]})
    finally:
        srv.stop(0)

    alibi: dict[str, Any] | None = None
    if args.alibi_python:
        script = Path(__file__).with_name("_drift_alibi.py")
        res = subprocess.run([args.alibi_python, str(script), str(out), ",".join(label for label, *_ in SHIFTS)],
                             capture_output=True, text=True, check=False)
        if res.returncode:
            print(f"alibi-detect run failed:\n{res.stderr[-2000:]}", file=sys.stderr)
        else:
            alibi = json.loads(res.stdout.strip().splitlines()[-1])
    if alibi is not None:
        print(f"  alibi-detect MMD (p = 0.05): {alibi['calm_false']} false alarms "
              f"over {alibi['calm_windows']} layer-windows")

    print("\nshift (one window of 50)  calibrated: flagged  passes to detection (here / server)   "
          "W1 > 0.1: flagged" + ("   MMD p<0.05: flagged" if alibi else ""))
    for r in rows:
        det = " ".join(f"{r['passes_to_detection'][n] or '-'}/{r['server_detection_passes'][n] or '-'}" for n in LAYERS)
        line = f"  {r['shift']:<8} {len(r['flagged'])}/4   {det:<32}  {len(r['fixed_flagged'])}/4"
        if alibi:
            line += f"   {len(alibi['shift'][r['shift']])}/4"
        print(line + ("" if r["cleared"] else "   (alarm had not cleared before this shift)"))
    print("clean windows before each shift: " + ", ".join(f"{r['shift']} {r['clean_windows']}" for r in rows))
    print("\nscore/threshold at the end of each shifted window: " + "; ".join(
        f"{r['shift']} {r['ratio']}" for r in rows))
    print(f"wall time {time.monotonic() - t0:.0f} s; windows in {out}")
    print(json.dumps({"false_alarms": false_alarms, "fixed_false_alarms": fixed_alarms, "shifts": rows,
                      "alibi": alibi}))


if __name__ == "__main__":
    main()
