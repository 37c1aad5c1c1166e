"""Time variants of eyas's row product kernel against the kernel as it is, and against oneDNN's, on a real target's
weights, at one input row (a plain step's) or several (a verify's).

    python benchmarks/kernel_variants.py --dtype bf16 --variant kAhead=1024 --variant kAhead=1536 kStreams=6
    python benchmarks/kernel_variants.py --dtype fp32 --rows 1 2 4 8 16 32 --onednn
    git show REV:models/row_gemv.cpp > /tmp/before.cpp
    python benchmarks/kernel_variants.py --rows 1 4 16 --other /tmp/before.cpp

Each variant is models/row_gemv.cpp with `constexpr` constants replaced (`NAME=VALUE ...`), built beside the source's
own kernel under another op namespace, so every variant runs in one process on the same weights; `--other` builds
other sources of the kernel (an earlier commit's) the same way. `--onednn` adds oneDNN's product of prepacked weights
(what eyas runs where the kernel does not take the rows: `cpu_kernels.py`).
A round runs each kernel over a decoding step's products in the graph's order and grouping (q/k/v and gate/up one
call each, then the lm_head), `--rows` input rows each; rounds alternate the kernels, so the machine's drift hits all
alike. Printed per row count: the median time of a round, the weights' bytes over it and their share of the
machine's read bandwidth (`ReadRate`: read before the rounds and after every 10, the upper median), and the median
per-round speed against the source's kernel. Every variant's outputs are checked equal to the source's first,
other sources' and oneDNN's (which may sum in another order) close to them.
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path
from typing import Callable

import torch
from step_ab import alternate  # beside this script

from eyas.inference.memory_limit import ReadRate
from eyas.models import Target, row_gemv


def build(source: str, assignments: list[str], namespace: str, directory: Path) -> object:
    """The kernel of `source` with each NAME=VALUE constant replaced, loaded as torch.ops.<namespace>.row_gemv."""
    text = source.replace("TORCH_LIBRARY(eyas,", f"TORCH_LIBRARY({namespace},")
    text = text.replace("TORCH_LIBRARY_IMPL(eyas,", f"TORCH_LIBRARY_IMPL({namespace},")
    for assignment in assignments:
        name, value = assignment.split("=", 1)
        text, n = re.subn(rf"(constexpr \w+ {re.escape(name)} = )[^;]+;", rf"\g<1>{value};", text)
        if n != 1:
            raise SystemExit(f"{name!r} is not one constexpr in row_gemv.cpp; name a constant it defines")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kernel.cpp").write_text(text)
    row_gemv.build(namespace, directory / "kernel.cpp", directory)
    return getattr(torch.ops, namespace).row_gemv


def step_products(target: Target) -> list[list[torch.Tensor]]:
    """A plain step's weights, grouped as the compiled step calls the kernel (q/k/v and gate/up one call each, o and
    down alone), the lm_head last; the modules named as Llama names them."""
    groups: list[list[torch.Tensor]] = []
    for layer in target._layers:
        a, m = layer.self_attn, layer.mlp
        groups += [[a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], [a.o_proj.weight],
                   [m.gate_proj.weight, m.up_proj.weight], [m.down_proj.weight]]
    return groups + [[target.lm_head.weight]]


def onednn(groups: list[list[torch.Tensor]]) -> Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]:
    """oneDNN's product of x by a group's weights, concatenated (as a compiled step fuses them) and prepacked once."""
    packed = {id(g): torch.ops.mkldnn._reorder_linear_weight(torch.cat(g), None) for g in groups}
    return lambda x, g: torch.ops.mkldnn._linear_pointwise(x, packed[id(g)], None, "none", [], "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="a Llama-shaped model (q/k/v/o, gate/up/down)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME=VALUE",
                   help="constants of row_gemv.cpp to replace, e.g. kAhead=1024 kStreams=6 (repeat for more)")
    p.add_argument("--rows", type=int, nargs="+", default=[1],
                   help=f"input rows per call, one table each (1: a plain step; up to {row_gemv.MAX_ROWS})")
    p.add_argument("--other", nargs="+", type=Path, default=[], metavar="PATH",
                   help="other sources of row_gemv.cpp to build and time beside it (an earlier commit's)")
    p.add_argument("--onednn", action="store_true", help="time oneDNN's prepacked product beside the kernels")
    p.add_argument("--rounds", type=int, default=100)
    args = p.parse_args(argv)
    if row_gemv.isa() is None:
        raise SystemExit("this CPU has no instruction set eyas's kernel is built for (AVX2 or better)")
    if not all(1 <= n <= row_gemv.MAX_ROWS for n in args.rows):
        raise SystemExit(f"--rows: each from 1 to {row_gemv.MAX_ROWS} (the kernel hands more to F.linear)")
    source = row_gemv.SOURCE.read_text()
    kernels = {}
    variants = ["as is", *(" ".join(a) for a in args.variant)]
    with tempfile.TemporaryDirectory(prefix="eyas-kernel-variants-") as tmp:
        for i, assignments in enumerate([[], *args.variant]):
            name = " ".join(assignments) or "as is"
            kernels[name] = build(source, assignments, f"eyas_variant{i}", Path(tmp) / str(i))
        for i, path in enumerate(args.other):
            if not path.is_file():
                raise SystemExit(f"--other: no file {path}")
            kernels[str(path)] = build(path.read_text(), [], f"eyas_other{i}", Path(tmp) / f"other{i}")
        target = Target.load(args.target, dtype=args.dtype, device="cpu")
        groups = step_products(target)
        if args.onednn:
            kernels["oneDNN prepacked"] = onednn(groups)
        nbytes = sum(w.numel() * w.element_size() for g in groups for w in g)
        print(f"{args.target} {args.dtype}: {len(groups)} calls, {nbytes / 1e6:.0f} MB a round, "
              f"{torch.get_num_threads()} threads, medians of {args.rounds} rounds", flush=True)
        for n in args.rows:
            rows = [torch.randn(n, g[0].shape[1], dtype=target.dtype) for g in groups]
            check(kernels, rows, groups, variants)
            took, bandwidth = timed_rounds(kernels, rows, groups, args.rounds, nbytes)
            base = took["as is"]
            print(f"{n} row{'s' * (n > 1)} a call; read bandwidth {bandwidth / 1e9:.1f} GB/s")
            for name, times in took.items():
                median = statistics.median(times)
                speed = statistics.median([b / t for b, t in zip(base, times)])
                print(f"  {name:30s} {median * 1e3:7.2f} ms  {nbytes / median / 1e9:5.1f} GB/s "
                      f"({nbytes / median / bandwidth:4.0%} of it)  speed {speed:.3f}", flush=True)


def check(kernels: dict[str, Callable], rows: list[torch.Tensor], groups: list[list[torch.Tensor]],
          variants: list[str]) -> None:
    """The variants' products equal the kernel's as it is; other kernels' (other sums) close to them."""
    reference = [kernels["as is"](x, g) for x, g in zip(rows, groups)]
    for name, kernel in kernels.items():
        same = torch.equal if name in variants else (
            lambda a, b: torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2))
        if not all(same(kernel(x, g), r) for x, g, r in zip(rows, groups, reference)):
            raise SystemExit(f"{name!r} computes other products than the kernel as it is")


def timed_rounds(kernels: dict[str, Callable], rows: list[torch.Tensor], groups: list[list[torch.Tensor]],
                 rounds: int, nbytes: int) -> tuple[dict[str, list[float]], float]:
    """Seconds a round per kernel, the kernels in turn each round (step_ab.alternate); and the read bandwidth sampled
    before the rounds and after every 10."""
    reads = ReadRate()
    reads.sample()
    products = {name: (lambda kernel=kernel: [kernel(x, g) for x, g in zip(rows, groups)])
                for name, kernel in kernels.items()}
    took = alternate(products, rounds, after=lambda r: reads.sample() if r % 10 == 9 else None)
    return took, reads.limit(nbytes).bandwidth


if __name__ == "__main__":
    main()
