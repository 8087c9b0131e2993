"""Taps: which layers, which point and which passes are observed; and raw-tensor capture."""
