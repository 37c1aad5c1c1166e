"""What "identical" means in bf16: where eyas's greedy output parts from `generate`'s, how far apart the target's
logits were there.

    python benchmarks/bf16_identity.py --head runs/drafters/eagle3/head --per-category 2

For each MT-bench question both decode greedily in bf16 (eyas with the head, `generate` one token at a time). At
the first token where they part, the target scores the shared prefix once more, one token at a time (the way
`generate` did), and the report gives the gap between its top two logits there, beside the logit scale: a tree
verify computes the same logits over several tokens at once, which bf16 rounds differently, so a near-tie can go
the other way. Prints one line per question and a summary (the largest gap at which outputs parted).
"""

from __future__ import annotations

import argparse

import torch

from eyas.inference import SpeculativeGenerator
from eyas.inference.bench import load_questions, prompt_ids
from eyas.models import Target, load_head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", required=True)
    p.add_argument("--questions", default="mt-bench")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    target = Target.load(args.target, dtype="bf16", device="cpu")
    head = load_head(args.head, target, dtype="bf16")
    gen = SpeculativeGenerator(target, head)
    eos = target.eos_ids()
    gaps, same = [], 0
    for q in load_questions(args.questions, None, args.per_category):
        ids = prompt_ids(target, q)
        ours = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=0.0).tokens
        ref = target.model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
        part = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if part is None:
            same += 1
            print(f"{q.question_id:>4} {q.category:<10} identical ({len(ours)} tokens)")
            continue
        logits = _one_token_logits(target, ids, ref[:part])
        top = logits.float().topk(2)
        gap = float(top.values[0] - top.values[1])
        scale = float(logits.float().abs().max())
        gaps.append(gap)
        print(f"{q.question_id:>4} {q.category:<10} parts at token {part}: generate {ref[part]} / eyas {ours[part]}; "
              f"top-2 logit gap {gap:.4f} (logits up to {scale:.1f}: {gap / scale:.1e} of the scale)")
    print(f"\n{same} of {same + len(gaps)} identical; where outputs parted, the target's top two logits were at most "
          f"{max(gaps, default=0):.4f} apart (bf16 resolves about {2 ** -8:.4f} of a logit's size)")


@torch.no_grad()
def _one_token_logits(target: Target, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """The target's logits after prompt + generated, decoded as `generate` decodes: the prompt in one forward, then
    one token at a time."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.model.config)
    logits = target.model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    for token in generated:
        logits = target.model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
    return logits


if __name__ == "__main__":
    main()
