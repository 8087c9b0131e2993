"""layertap server: hosts a PyTorch model and taps its layers over gRPC.

The subpackages are the stages a tensor summary goes through, in order::

    host/      model sources, the model host (passes), hook registration
    taps/      which layers, when (selectors, sampling, tap files), and capture
    reducers/  summarize each tapped tensor on its device, then one copy to host
    stream/    the publisher (a pass's values become summaries, for the broker and
               every sink) and the broker that fans them out to subscribers
    drift/     a sink: baselines and drift scores computed from those summaries
    record/    a sink: the flight recorder (triggers, retained inputs, replayed incidents)
    export/    a sink and scrape-time collectors: Prometheus, exposition over HTTP
    explain/   Grad-CAM on the hosted model
    rpc/       gRPC services that expose all of the above, one servicer per resource
    train/     ``layertap.attach``: a training process serves its own model
    cli/       the server's command lines (``layertap serve``, ``layertap demo drift``)

``app`` wires the stages together (the training agent and the CLIs call it);
``codec`` is the tensor wire format shared by ``host`` and ``rpc``; ``errors``
is the domain error hierarchy. ``docs/design.md`` draws the stage graph.
"""
