"""Export: Prometheus health and pipeline self-metrics, per-layer snapshots, and the /metrics endpoint."""
