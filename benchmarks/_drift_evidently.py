"""Evidently's data-drift metric on the windows ``drift_power.py`` wrote (run under its own venv).

    /work/venv-evidently/bin/python benchmarks/_drift_evidently.py DIR "+0.05σ,+0.1σ,..." [layer1,layer2,...] [ks]

Evidently (0.7.x, from PyPI) is a benchmark-only peer: it needs pandas<3 and no torch, so it
lives in a venv of its own and imports nothing of layertap. How a layer becomes Evidently
data: one numerical column per feature (channel, or hidden unit of a transformer), one row
per pass holding that pass's mean of the feature, i.e. exactly the rows alibi-detect's MMD
gets. The reference is the baseline's passes, the current data one window of passes.
Evidently's ``DriftedColumnsCount`` (the metric behind ``DataDriftPreset``) runs its
``wasserstein`` stattest (W1 normed by the reference column's std) at threshold 0.1 on each
column, and calls the dataset drifted when the share of drifted columns reaches
``drift_share`` = 0.5, its default. (The pooled alternative, all of a layer's activations as
one column, is what ``drift_power.py`` already scores with the same 0.1 on the server's pooled
histogram of the raw activations, which these files do not hold.) With a fourth argument
``ks`` the per-column test is Kolmogorov-Smirnov at Evidently's default p < 0.05 instead: the
test Evidently picks on its own for a numerical column whose reference has at most 1000 rows
(W1 > 0.1 is its default only above that). Prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import evidently
import numpy as np
import pandas as pd
from evidently import DataDefinition, Dataset, Report
from evidently.metrics import DriftedColumnsCount

LAYERS = ["layer1", "layer2", "layer3", "layer4"]
THRESHOLD, DRIFT_SHARE = 0.1, 0.5


class Scorer:
    def __init__(self, reference: np.ndarray) -> None:
        self.cols = [f"f{i}" for i in range(reference.shape[1])]
        self.definition = DataDefinition(numerical_columns=self.cols)
        self.reference = self._dataset(reference)

    def _dataset(self, rows: np.ndarray) -> Dataset:
        return Dataset.from_pandas(pd.DataFrame(rows, columns=self.cols), data_definition=self.definition)

    def share(self, window: np.ndarray, method: str) -> float:
        threshold = THRESHOLD if method == "wasserstein" else None  # None: the test's own default (K-S: p 0.05)
        report = Report([DriftedColumnsCount(method=method, threshold=threshold, drift_share=DRIFT_SHARE)])
        value = report.run(self._dataset(window), self.reference).dict()["metrics"][0]["value"]
        return float(value["share"])


def main() -> None:
    out, shifts = Path(sys.argv[1]), sys.argv[2].split(",")
    layers = sys.argv[3].split(",") if len(sys.argv) > 3 else LAYERS
    method = sys.argv[4] if len(sys.argv) > 4 else "wasserstein"
    scorers = {n: Scorer(np.load(out / f"base_{n}.npy")) for n in layers}
    shares = []
    calm_false = 0
    for n in layers:
        for window in np.load(out / f"calm_{n}.npy"):
            shares.append(scorers[n].share(window, method))
            calm_false += int(shares[-1] >= DRIFT_SHARE)
    shifted = {}
    for s in shifts:
        got = [scorers[n].share(np.load(out / f"shift_{s}_{n}.npy"), method) for n in layers]
        shifted[s] = {"flagged": [n for n, x in zip(layers, got, strict=True) if x >= DRIFT_SHARE], "share": got}
    print(json.dumps({"version": evidently.__version__, "method": method, "drift_share": DRIFT_SHARE, "calm_false": calm_false,
                      "calm_windows": len(shares), "calm_share_median": statistics.median(shares),
                      "calm_share_max": max(shares), "shift": shifted}))


if __name__ == "__main__":
    main()
