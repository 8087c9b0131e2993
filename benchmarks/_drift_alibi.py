"""alibi-detect's MMD drift detector on the windows ``drift_power.py`` wrote (run under its own venv).

    /work/venv-alibi/bin/python benchmarks/_drift_alibi.py DIR "+0.05σ,+0.1σ,..." [layer1,layer2,...]

alibi-detect 0.13 needs numpy<2 (and transformers<5), so it runs in a venv of its own with
the CPU torch wheel as its backend; it imports nothing of layertap. Per layer, the reference
is the baseline's passes (one row of per-feature means per pass), and each window of 50
passes is one test batch at p = 0.05. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from alibi_detect.cd import MMDDrift

LAYERS = ["layer1", "layer2", "layer3", "layer4"]


def main() -> None:
    out, shifts = Path(sys.argv[1]), sys.argv[2].split(",")
    layers = sys.argv[3].split(",") if len(sys.argv) > 3 else LAYERS
    detectors = {n: MMDDrift(np.load(out / f"base_{n}.npy").astype(np.float32), backend="pytorch", p_val=0.05,
                             n_permutations=100) for n in layers}
    calm_false = calm_windows = 0
    for n in layers:
        for window in np.load(out / f"calm_{n}.npy"):
            calm_windows += 1
            calm_false += int(detectors[n].predict(window.astype(np.float32))["data"]["is_drift"])
    flagged = {s: [n for n in layers
                   if detectors[n].predict(np.load(out / f"shift_{s}_{n}.npy").astype(np.float32))["data"]["is_drift"]]
               for s in shifts}
    print(json.dumps({"calm_false": calm_false, "calm_windows": calm_windows, "shift": flagged}))


if __name__ == "__main__":
    main()
