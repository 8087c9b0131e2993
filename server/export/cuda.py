"""CUDA allocator memory per device, read at scrape time.

Reading at scrape time keeps the model thread free of metric updates; both
readings are host-side allocator counters, so a scrape never syncs the device.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CudaMemoryCollector", "cuda_available"]


def cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA device."""
    try:
        import torch  # noqa: PLC0415 - a thin install has no torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class CudaMemoryCollector(Collector):
    """``layertap_cuda_memory_{allocated,reserved}_bytes`` per device."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name

    def describe(self) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("layertap_cuda_memory_allocated_bytes", "CUDA memory held by tensors.", labels=["model", "device"]),
            GaugeMetricFamily("layertap_cuda_memory_reserved_bytes", "CUDA memory reserved by the caching allocator.", labels=["model", "device"]),
        ]

    def collect(self) -> Iterator[Metric]:
        import torch  # noqa: PLC0415 - registered only where cuda_available() found it

        alloc, reserved = self.describe()
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                # Both read allocator counters on the host: no device sync.
                alloc.add_metric([self.model, str(i)], float(torch.cuda.memory_allocated(i)))
                reserved.add_metric([self.model, str(i)], float(torch.cuda.memory_reserved(i)))
        yield alloc
        yield reserved
