"""Generate: the step loop over the model's own KV cache, its requests and the running batch."""
