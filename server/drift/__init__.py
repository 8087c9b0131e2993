"""Drift: baselines frozen from summaries, and scores of a live window against them."""
