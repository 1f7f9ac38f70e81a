"""The platform's one memory probe: peak torch allocations of a block of code above its start, on any device.

- CUDA: `torch.cuda.max_memory_allocated` (after `reset_peak_memory_stats`) minus the allocation at the start.
- CPU: the profiler's memory events (`profile_memory=True`): each op's own allocations and frees summed in time
  order, their running maximum. The resident set size is not used: after a warm-up the allocator reuses freed
  pages, so a repeated block never grows it, and it counts Python objects and libraries besides tensors.

Both count live tensor memory only, so CPU and GPU numbers mean the same thing. The CPU profiler slows the
block down: time a block and measure its memory in separate runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

MEASURE = "peak torch allocations above the start of each block (CUDA allocator statistics; CPU profiler memory events), MB"


@dataclass
class Peak:
    """Filled when the measured block ends: `mb` = peak allocations above the block's start, in MiB."""

    mb: float | None = None


@contextmanager
def peak_memory(device: torch.device | str) -> Iterator[Peak]:
    """Measure the peak torch allocations of the enclosed block above its start (module docstring).

    Yields a Peak whose `mb` is set when the block exits normally.
    """
    device = torch.device(device)
    peak = Peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield peak
        torch.cuda.synchronize(device)
        peak.mb = (torch.cuda.max_memory_allocated(device) - before) / 2**20
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield peak
    peak.mb = _profiled_peak_bytes(prof) / 2**20


def _profiled_peak_bytes(prof) -> int:
    """Running maximum of allocations minus frees over the profiler's events, in time order (bytes, ≥ 0)."""
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak
