"""layertap server: hosts a PyTorch model and taps its layers over gRPC.

The subpackages are the stages a tensor summary goes through, in order::

    host/      model sources, the model host (passes), hook registration
    taps/      which layers, when (selectors, sampling, tap files), and capture
    reducers/  summarize each tapped tensor on its device, then one copy to host
    stream/    the broker that fans a pass's summaries out to sinks and subscribers
    drift/     baselines and drift scores computed from those summaries
    record/    flight recorder: triggers on summaries, retained inputs, replayed incidents
    export/    Prometheus: self-metrics, per-layer snapshots, exposition over HTTP
    rpc/       gRPC services that expose all of the above

``app`` wires the stages together; ``codec`` is the tensor wire format shared by
``host`` and ``rpc``; ``errors`` is the domain error hierarchy.
"""
