"""Reducers: summarize a tapped tensor on its device, then move a pass's results to host in one copy."""
