"""The memory limit of plain decoding: a one-token step reads every weight once, so it cannot take less than the
weights' bytes over the rate this machine reads memory at. `eyas bench` measures it in the same run as the runtimes
it judges, sampled between its questions (the machine's rate drifts on a shared host: `ReadRate`), and
benchmarks/bench_forward.py per forward."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .timing import synchronize


def read_bandwidth(device: torch.device | str = "cpu", gib: float = 1.0, repeats: int = 5) -> tuple[float, str]:
    """(bytes per second, kernel): the fastest read of a `gib` GiB fp32 buffer on `device`, far larger than the
    caches, by any of a few streaming kernels (a sum, a max, a matrix-vector product: what a one-row linear runs),
    the best of `repeats` each, with torch's current threads. The highest rate the machine reaches makes the
    strictest limit."""
    device = torch.device(device)
    x = torch.ones(int(gib * 2**30) // 4 // 4096, 4096, device=device)
    v = torch.ones(4096, device=device)
    kernels: dict[str, Callable[[], object]] = {"sum": x.sum, "amax": x.amax, "mv": lambda: torch.mv(x, v)}
    rates = {}
    for name, fn in kernels.items():
        fn()  # first touch
        best = float("inf")
        for _ in range(repeats):
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
        rates[name] = x.nbytes / best
    name = max(rates, key=rates.get)
    return rates[name], name


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a one-token step of `model` (a CausalLM) reads: every parameter once (a tied lm_head and
    embedding are one tensor), but of an untied input embedding only the token's row, left out."""
    params = {p.data_ptr(): p.nbytes for p in model.parameters()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embed.weight.data_ptr() != head.weight.data_ptr():
        params.pop(embed.weight.data_ptr(), None)
    return sum(params.values())


@dataclass(frozen=True)
class MemoryLimit:
    """What bounds plain decoding: `bytes` read a step (the weights) at `bandwidth` bytes per second (measured with
    `kernel`). The cache's keys and values, read too, are left out: the limit is an upper bound on tokens/s.
    Measured `samples` times through a run, `bandwidth` the upper median of the samples and `low`/`high` their range
    (`ReadRate`)."""

    bandwidth: float
    kernel: str
    bytes: int
    samples: int
    low: float
    high: float

    @property
    def tokens_per_s(self) -> float:
        return self.bandwidth / self.bytes

    def as_dict(self) -> dict[str, float | int | str]:
        return {"bandwidth": self.bandwidth, "kernel": self.kernel, "bytes": self.bytes,
                "tokens_per_s": self.tokens_per_s, "samples": self.samples, "low": self.low, "high": self.high}


class ReadRate:
    """The machine's read bandwidth through a run, sampled (`read_bandwidth`) between the timings it judges. A shared
    host's rate drifts both ways: other guests' traffic slows reads, and now and then one read runs far above the
    rate the machine holds (seen: one 57.8 GB/s read among samples of 31-35 on a 2-core EPYC), which no timing of the
    same minutes reached. The rate that counts is the upper median of the samples: with two it is the higher, as
    strict as the fastest; from three on, a lone spike does not set it. The range is kept and reported beside it."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.samples: list[tuple[float, str]] = []

    def sample(self) -> float:
        """Read now; returns this sample's bytes per second."""
        rate, kernel = read_bandwidth(self.device)
        self.samples.append((rate, kernel))
        return rate

    def limit(self, nbytes: int) -> MemoryLimit:
        """The memory limit of a step reading `nbytes`, at the upper median of the samples taken so far."""
        if not self.samples:
            raise ValueError("no bandwidth sample yet: call sample() first")
        ordered = sorted(self.samples)
        rate, kernel = ordered[len(ordered) // 2]
        return MemoryLimit(rate, kernel, nbytes, len(ordered), ordered[0][0], ordered[-1][0])

