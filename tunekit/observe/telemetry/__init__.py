"""Telemetry sampled in the background while a job runs: NVML, host (psutil), py-spy.

See :mod:`tunekit.observe.telemetry.sampler` for the sampler and the time series.
"""

from tunekit.observe.telemetry.host import HostSource, summarize_host
from tunekit.observe.telemetry.nvml import NvmlSource, summarize_nvml
from tunekit.observe.telemetry.pyspy import PySpySource, classify, find_pyspy, summarize_pyspy
from tunekit.observe.telemetry.sampler import (
    PidSource,
    TelemetrySampler,
    TimeSeries,
    read_pid_dir,
    resolve_pids,
)

__all__ = [
    "HostSource",
    "NvmlSource",
    "PidSource",
    "PySpySource",
    "TelemetrySampler",
    "TimeSeries",
    "classify",
    "find_pyspy",
    "read_pid_dir",
    "resolve_pids",
    "summarize_host",
    "summarize_nvml",
    "summarize_pyspy",
]
