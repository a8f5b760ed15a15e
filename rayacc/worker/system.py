"""Each node's CPU, memory and GPU figures (`tracking.system_metrics`), sampled with MLflow's
own system-metrics monitors by the first rank on the node. They travel with the ranks' figures
(observe/ranks.py: inside the window's gradient reduction) to rank 0, and the driver, the run's
only writer, logs them as MLflow's system metrics of that node, `system/<node>/<name>`, as
`mlflow.system_metrics` names them with a node id. No worker talks to the tracking server."""

from __future__ import annotations

import math
import os
import statistics
import time
import weakref

__all__ = ["NAMES", "NodeSampler", "ResidentMemory"]

NAMES = (
    "cpu_utilization_percentage",
    "system_memory_usage_megabytes",
    "system_memory_usage_percentage",
    "gpu_utilization_percentage",
    "gpu_memory_usage_megabytes",
)
"""MLflow's CPU monitor's names, and its GPU monitor's over the node's GPUs (utilisation:
their mean; memory: their sum); the GPU figures are 0 where there is no NVIDIA GPU."""
SAMPLE_EVERY_S = 1.0
"""psutil and NVML calls, at most once a second (a window may take milliseconds)."""


class NodeSampler:
    """`samples`: this rank is the first on its node (the others report zeros, which the
    figures of the node never read)."""

    def __init__(self, samples: bool):
        self.samples = samples
        self.cpu = self.gpu = None
        if samples:
            from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor

            self.cpu = CPUMonitor()
            try:
                from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

                self.gpu = GPUMonitor()
            except (ImportError, RuntimeError):  # no NVML here: CPU and memory only
                self.gpu = None
        self._last = [0.0] * len(NAMES)
        self._at = -math.inf

    def figures(self) -> list[float]:
        """The node's figures now (or as of the last second), in `NAMES` order."""
        if self.cpu is None:
            return self._last
        now = time.monotonic()
        if now - self._at < SAMPLE_EVERY_S:
            return self._last
        self._at = now
        self.cpu.collect_metrics()
        cpu = self.cpu.aggregate_metrics()
        self.cpu.clear_metrics()
        util, memory = 0.0, 0.0
        if self.gpu is not None:
            self.gpu.collect_metrics()
            gpu = self.gpu.aggregate_metrics()
            self.gpu.clear_metrics()
            utils = [v for k, v in gpu.items() if k.endswith("_utilization_percentage")]
            util = statistics.fmean(utils) if utils else 0.0
            memory = sum(v for k, v in gpu.items() if k.endswith("_memory_usage_megabytes"))
        self._last = [*(float(cpu[name]) for name in NAMES[:3]), util, memory]
        return self._last


class ResidentMemory:
    """This process's resident memory in MiB (`mem/rss_mb`, a rank's `host_mb`), read every
    window: one read of `/proc/self/statm` through a file kept open, where psutil opens,
    reads and parses it each call (about 50 µs a window after a step, 1.5 % of the default
    job's 3 ms window; the kept file: under a tenth of that in a hot loop). psutil where there
    is no `/proc`."""

    def __init__(self) -> None:
        self._page_mb = os.sysconf("SC_PAGE_SIZE") / 2**20
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            import psutil

            self._fd, self._process = None, psutil.Process()
        else:
            weakref.finalize(self, os.close, self._fd)

    def mb(self) -> float:
        if self._fd is None:
            return self._process.memory_info().rss / 2**20
        # statm: size resident shared text lib data dt, in pages; read afresh at offset 0
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page_mb
