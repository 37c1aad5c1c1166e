"""The inductor pass a compiled decoding step runs on CPU (`Target(compile=True)`), on its aten graph before inductor
freezes the weights:
- products of one row, or of a few where that kernel is faster than torch's (`cpu_kernels.row_kernel_takes`), to
  eyas's row kernel (`row_gemv.rewrite_products`), on x86 CPUs with AVX2 or better;
- the attention of a few query rows to eyas's attention kernel (`cpu_kernels.attention_kernel_takes`), and other
  bf16 attention to fp32 where the CPU has no bf16 units, what an eager forward's attention does there too
  (`cpu_kernels.rewrite_attention`)."""

from __future__ import annotations

import functools
import hashlib

from torch import fx

from . import cpu_kernels, row_gemv, weight_arena


def rewrite_step(graph: fx.Graph) -> None:
    row_gemv.rewrite_products(graph, cpu_kernels.row_kernel_takes, weight_arena.arena_of)
    cpu_kernels.rewrite_attention(graph)


@functools.cache
def step_pass():
    """The pass, as inductor's `joint_custom_pre_pass` takes it. Its uuid keys inductor's cache of compiled graphs:
    the sources of the rewrites and of the kernel, and what decides them on this CPU (the kernel's instruction set,
    native bf16), so a cache shared by machines of other CPUs never hands one a graph rewritten for another."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class StepPass(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            rewrite_step(graph)

        def uuid(self) -> bytes:
            files = get_hash_for_files((__file__, row_gemv.__file__, str(row_gemv.SOURCE), cpu_kernels.__file__,
                                        weight_arena.__file__))
            return hashlib.sha256(files + f"{row_gemv.isa()} {cpu_kernels.native_bf16()}".encode()).digest()

    return StepPass()
