"""What a compiled step's fixed costs become on caches a step's weight reads have emptied.

    python benchmarks/fixed_cost_cold.py --flush-mb 1 4 16 64 --rounds 200

A 30-layer model with hidden size 64 (its weights ~1 MB), compiled as eyas compiles a target: its plain step is
nearly all fixed cost (the graph's code between kernels, tensor handles, small kernels, Python around the graph).
A real target's step runs that code after every product has streamed megabytes of weights through the caches, so it
finds its code and data evicted. Each round times one step right after another (caches warm) and, per --flush-mb,
one step right after a read of a buffer of that size (the caches emptied as far as that read reaches). Printed: the
median step per case.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_ab import forwards  # beside this script
from transformers import LlamaConfig, LlamaForCausalLM

from eyas.models import Target


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flush-mb", type=int, nargs="+", default=[1, 4, 16, 64], help="sizes of the reads before a step")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    args = p.parse_args(argv)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=64, vocab_size=512, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    step = forwards({"tiny": Target(model, None, "tiny", compile=True)}, args.context)["tiny"]
    # per case, what runs before the timed step: the step itself (warm caches) or a read of a buffer
    before = {"warm": step, **{f"after {mb} MB read": torch.ones(mb << 20, dtype=torch.uint8).sum
                                for mb in args.flush_mb}}
    took: dict[str, list[float]] = {case: [] for case in before}
    for _ in range(args.rounds):
        for case, prepare in before.items():
            prepare()
            t0 = time.perf_counter()
            step()
            took[case].append(time.perf_counter() - t0)
    for case, seconds in took.items():
        print(f"{case}: median {1e3 * statistics.median(seconds):.3f} ms")


if __name__ == "__main__":
    main()
