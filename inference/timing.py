"""Wall time on any device, without stalling a GPU to read it.

On CUDA a `Stopwatch` records events in the stream, so marking a phase adds no host sync; the times
are read (`between`) after the caller has synchronised anyway (a speculative cycle does when it reads
how many tokens each row accepted). On CPU a mark is `time.perf_counter()`.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between(self, start, end) -> float:
        """Seconds from mark `start` to mark `end` (on CUDA: both events must have completed)."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
