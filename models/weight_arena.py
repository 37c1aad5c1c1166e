"""A CPU target's weights moved into one buffer backed by huge pages, in the order a decoding step reads them.

A one-row decoding step is a read of every weight, one product after another: on a CPU each product starts cold (its
first rows miss the TLB and the hardware prefetchers have not found the stream yet), and a model loaded tensor by tensor
scatters its weights over 4 KiB pages anywhere in memory. One anonymous mapping that the kernel backs with 2 MiB pages
(`MADV_HUGEPAGE`: a TLB entry covers 512 times the bytes), holding the weights back to back in the order the model
registers them (a decoder layer's products in the order its forward runs them) with the output embedding last, takes
1-5 % (median ~2 %) off a compiled bf16 SmolLM2-135M step and nothing measurable off an fp32 one
(`benchmarks/weight_layout_ab.py`, docs/design/cpu-kernels.md). The values, shapes, dtypes and Parameter objects stay as
they were (tied weights stay one Parameter); only where their bytes live changes, one weight at a time, so the old
storage is freed as the copy goes and the peak is the model plus one weight.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from typing import Sequence

import torch
from torch import nn

from .cpu_kernels import whole

logger = logging.getLogger(__name__)

_ALIGN = 64  # a cache line: every weight starts on one
# per arranged model: its buffer as one uint8 tensor (None: arranged elsewhere), which also keeps the buffer mapped
_ARRANGED: "weakref.WeakKeyDictionary[nn.Module, torch.Tensor | None]" = weakref.WeakKeyDictionary()


def movable(p: nn.Parameter) -> bool:
    """Whether a weight may move: a plain contiguous CPU tensor held whole that owns its storage (a view into a larger
    buffer would leave that buffer alive and the bytes twice in memory)."""
    return (p.device.type == "cpu" and whole(p) and p.is_contiguous() and p.numel() > 0
            and p.untyped_storage().nbytes() == p.nbytes)


def arrange_weights(model: nn.Module, last: nn.Parameter | None = None) -> int:
    """Move `model`'s movable parameters (`movable`) into one huge-page-backed buffer, in registration order with `last`
    (the output embedding) at the end; returns the bytes moved (0 where the model was arranged already or nothing
    moves). Where huge pages are not available the buffer is ordinary memory, still in order."""
    if model in _ARRANGED:
        return 0
    params = [p for p in model.parameters() if p is not last and movable(p)]  # tied weights once
    if last is not None and movable(last):
        params.append(last)
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.nbytes + (-p.nbytes) % _ALIGN
    if total == 0:
        return 0
    # private and anonymous: the kernel aligns a large one to 2 MiB, and only private memory takes transparent huge
    # pages everywhere (shared anonymous memory follows shmem's setting, often off)
    buffer = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # a kernel without transparent huge pages: ordinary pages, the same order
            logger.debug("no huge pages for the target's weights (%s)", e)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            # a storage of its own per weight (each keeps the mapping alive), not views of one: inductor's GEMM
            # templates, packing frozen weights that share a storage, computed wrong products (torch 2.13)
            moved = torch.frombuffer(buffer, dtype=p.dtype, count=p.numel(), offset=offset).view(p.shape)
            moved.copy_(p.data)
            p.data = moved
    _ARRANGED[model] = torch.frombuffer(buffer, dtype=torch.uint8)
    logger.debug("moved %d weights (%.0f MB) into one buffer in step order", len(params), total / 1e6)
    return total


def arena_of(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """The buffer (1-D uint8) an arranged model's weights were moved into that holds all of `tensors`, and each one's
    byte offset in it; None where they do not all lie whole in one."""
    for arena in _ARRANGED.values():
        if arena is None:
            continue
        start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
        if all(t.device.type == "cpu" and start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end for t in tensors):
            return arena, [t.data_ptr() - start for t in tensors]
    return None
