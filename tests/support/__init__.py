"""Test support: fixtures models, helpers and the no-sync guard (not shipped)."""
