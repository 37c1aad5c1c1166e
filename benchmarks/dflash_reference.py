"""The same DFlash head driven by eyas and by z-lab's reference (`dflash` 0.1.0: `DFlashDraftModel`,
`dflash_generate`) on the same prompts: outputs and accepted lengths per cycle must agree.

    python benchmarks/dflash_reference.py --head runs/drafters/dflash/head --per-category 1

The head is exported in z-lab's layout and loaded by its own `DFlashDraftModel`; both decode greedily in fp32 with
the whole block verified every cycle (eyas: a chain of block_size - 1, no planner, no lookup, as `dflash_generate`
verifies). Prints per question: tokens, tau of each, identical or where they part; then the totals.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eyas.inference import SpeculativeGenerator, TreeOptions
from eyas.inference.bench import load_questions, prompt_ids
from eyas.models import Target, export_head, load_head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", required=True, help="a DFlash head (any layout eyas reads)")
    p.add_argument("--questions", default="mt-bench")
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate

    dflash.model._cuda_time = time.perf_counter  # its stats time with torch.cuda.synchronize, which a CPU lacks

    target = Target.load(args.target, dtype="fp32", device="cpu")
    head = load_head(args.head, target)
    block = head.options.block_size
    gen = SpeculativeGenerator(target, head, TreeOptions(kind="chain", depth=block - 1, lookup=0))
    with tempfile.TemporaryDirectory() as tmp:
        export_head(args.head, Path(tmp) / "zlab", "zlab", target)
        reference = DFlashDraftModel.from_pretrained(Path(tmp) / "zlab", torch_dtype=torch.float32).eval()
    eos = target.eos_ids()
    totals = {"eyas": [0, 0, 0.0], "z-lab": [0, 0, 0.0]}  # tokens, cycles, seconds
    same = 0
    questions = load_questions(args.questions, None, args.per_category)
    for q in questions:
        ids = prompt_ids(target, q)
        t = time.perf_counter()
        ours = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0)
        ours_s = time.perf_counter() - t
        t = time.perf_counter()
        ref = dflash_generate(reference, target.model, torch.tensor([ids]), args.max_new_tokens, eos,
                              temperature=0.0, return_stats=True)
        ref_s = time.perf_counter() - t
        ref_tokens = ref.output_ids[0, len(ids):].tolist()
        identical = ours.tokens == ref_tokens and ours.stats.accepted == ref.acceptance_lengths
        same += identical
        for name, tokens, cycles, seconds in (("eyas", len(ours.tokens), len(ours.stats.accepted), ours_s),
                                              ("z-lab", len(ref_tokens), len(ref.acceptance_lengths), ref_s)):
            totals[name][0] += tokens
            totals[name][1] += cycles
            totals[name][2] += seconds
        part = next((i for i, (a, b) in enumerate(zip(ours.tokens, ref_tokens)) if a != b), None)
        ref_tau = sum(ref.acceptance_lengths) / len(ref.acceptance_lengths)
        print(f"{q.question_id:>4} {q.category:<10} tokens {len(ours.tokens)}/{len(ref_tokens)}  "
              f"tau eyas {ours.stats.mean_accepted:.2f} z-lab {ref_tau:.2f}  "
              + ("identical" if identical else f"part at token {part}"))
    for name, (tokens, cycles, seconds) in totals.items():
        print(f"{name:<6} tau {tokens / max(cycles, 1):.3f} over {cycles} cycles, {tokens / seconds:.1f} tok/s")
    print(f"{same} of {len(questions)} questions: the same tokens and the same accepted lengths per cycle")


if __name__ == "__main__":
    main()
