"""Model host: load a model, run passes one at a time, and register hooks on it."""
