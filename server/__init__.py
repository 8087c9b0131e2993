"""layertap server: hosts a PyTorch model and taps its layers over gRPC.

Data flow, one module each: model_sources -> model_host (passes, hooks) ->
capture / taps -> reducers -> collector -> broker -> services and metrics.
"""
