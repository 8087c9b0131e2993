"""Export: Prometheus self-metrics, per-layer snapshots, and the /metrics endpoint."""
