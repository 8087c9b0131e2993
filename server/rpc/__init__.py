"""RPC: the gRPC services that expose the host, taps, captures and drift."""
