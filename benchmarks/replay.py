"""Replay: planner variants compared on the same recorded drafts and the same measured costs, in seconds.

    python benchmarks/replay.py record --head HEAD [--questions mt-bench] [--limit 16] [--max-new-tokens 128] \\
        --out runs/replay/HEAD.json.gz
    python benchmarks/replay.py run runs/replay/*.json.gz

`record` decodes each question greedily through eyas and keeps, per question:
- the prompt and the target's continuation (greedy: whatever a planner drafts, the tokens are these);
- the head's full draft tree (every candidate's token, parent and score, at the full depth and top_k) rooted
  at every position of the continuation, so a replay can draft from wherever its cycles land;
- every cycle of one live speculative generation of it (the planner's inputs and the measured seconds of
  its draft and of the rest of the cycle), and the wall time of that generation and of eyas plain decoding.
`run` fits one cost model to all recorded cycles (this machine's costs, as costs.CostModel models them),
then decodes every question again with each planner variant: the variant decides, the recorded drafts and
the n-gram lookup (recomputed from the tokens) say what a cycle's tree holds, the continuation says what
the target accepts, and the cost model says what the cycle cost. Printed per variant: tokens/s under the
cost model relative to plain decoding, per question and overall (mean, worst, 10th percentile, share
slower than plain), beside the live generation's measured speedup. Greedy only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {  # name -> Planner keyword arguments
    "planner": {},
    "no guard": {"margin": 1e9, "slack": 1e9},
    "margin 0.5%": {"margin": 0.005},
    "margin 3%": {"margin": 0.03},
    "slack 0.25": {"slack": 0.25},
    "no lookup": {"lookup_max": 0},
}


VERSION = 2  # the prefill decides the first token; drafts are rooted at the continuation's tokens


# ---- recording ---------------------------------------------------------------------------------------------
def record(args: argparse.Namespace) -> None:
    import torch
    from tqdm.auto import tqdm

    from eyas.inference import SpeculativeGenerator, TreeOptions
    from eyas.inference.bench import load_questions, plain_decode, prompt_ids
    from eyas.inference.drafter import DraftContext, DynamicExpansion
    from eyas.inference.drafting import TreeDrafter
    from eyas.models import Target
    from eyas.models.sampling import Sampling

    torch.set_num_threads(args.threads)
    target = Target.load(args.target)
    head = load_head(args.head, target)
    options = TreeOptions(depth=args.depth, top_k=args.top_k)
    gen = SpeculativeGenerator(target, head, options)
    questions = load_questions(args.questions, args.limit, args.per_category)
    eos = target.eos_ids()
    warm = prompt_ids(target, questions[0])
    gen.generate(warm, max_new_tokens=8, eos_token_id=eos)  # calibrates; first-call costs stay out
    plain_decode(target, warm, 8, eos, Sampling(), 0)
    out = {"version": VERSION, "target": args.target, "head": args.head, "depth": args.depth, "top_k": args.top_k,
           "lookup": options.lookup, "threads": args.threads, "start": gen.planner.costs.start, "questions": []}
    for q in tqdm(questions, desc="record", unit="q"):
        ids = prompt_ids(target, q)
        t0 = time.perf_counter()
        continuation = plain_decode(target, ids, args.max_new_tokens, eos, Sampling(), 0)
        plain_s = time.perf_counter() - t0
        gen.planner.record = []
        t0 = time.perf_counter()
        res = gen.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        spec_s = time.perf_counter() - t0
        assert res.tokens == continuation, f"question {q.question_id}: speculation changed the greedy output"
        cycles, gen.planner.record = gen.planner.record, None
        # every position's full draft: the head fed the target's features along the continuation
        seq = ids + continuation
        dev = target.device
        with torch.no_grad():
            feats = target(torch.tensor([seq[:-1]], device=dev), logits=False, layer_ids=head.config.fused_layer_ids)
        feats = feats.features if head.config.fused_layer_ids else feats.hidden
        drafter = TreeDrafter(head, DynamicExpansion(args.depth, args.top_k))
        drafter.reset(1, len(seq) + args.depth + 4)
        # the prefill decides continuation[0]; draft j is rooted at continuation[j] (position n0 + j)
        n0 = len(ids)
        ctx = DraftContext(torch.tensor([seq[1:n0 + 1]], device=dev), feats[:, :n0],
                           torch.arange(n0, device=dev)[None], [n0])
        drafts = []
        for j in range(len(continuation) - 1):
            c = drafter.draft(ctx)
            drafts.append([c.tokens[0].tolist(), c.parents[0].tolist(), [round(x, 4) for x in c.scores[0].tolist()],
                           c.depth[0].tolist()])
            p = n0 + j  # the root's position; the next context entry is the token after it
            ctx = DraftContext(torch.tensor([[seq[p + 1]]], device=dev), feats[:, p:p + 1],
                               torch.tensor([[p]], device=dev), [1])
        out["questions"].append({"question_id": q.question_id, "category": q.category, "prompt": ids,
                                 "continuation": continuation, "drafts": drafts, "cycles": cycles,
                                 "prefill_s": res.stats.prefill_time_s, "plain_s": plain_s, "spec_s": spec_s})
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(out, f)
    tmp.replace(path)
    print(f"{path}: {len(out['questions'])} questions")


def load_head(spec: str, target):
    """A head folder, or `random`: an untrained EAGLE-3 head (seed 0), the head that never pays."""
    import torch

    from eyas.models import DraftHead, head_config_for
    from eyas.models import load_head as load

    if spec != "random":
        return load(spec, target)
    torch.manual_seed(0)
    return DraftHead(head_config_for(target, "eagle3", draft_vocab_size=8192), target)


# ---- replaying ---------------------------------------------------------------------------------------------
def truth(recordings: list[dict]):
    """One cost model of the recorded machine: every cycle of every recording, in order, none forgotten."""
    from eyas.inference.costs import CostModel

    start = recordings[0]["start"]
    costs = CostModel(**start, decay=1.0)
    for rec in recordings:
        for q in rec["questions"]:
            for c in q["cycles"]:
                costs.observe(c["nodes"], c["levels"], c["catchup"], c["context"], c["draft_s"], c["rest_s"])
    costs.learn = False
    return costs


def replay(rec: dict, q: dict, costs, planner) -> tuple[float, float]:
    """(seconds by the cost model, seconds of plain decoding by it) of one question decoded by `planner`."""
    import numpy as np
    import torch

    from eyas.inference.lookup import NgramIndex, accepted_prefix

    prompt, cont = q["prompt"], q["continuation"]
    lookup = planner.lookup_reached.shape[1]
    index = NgramIndex(prompt + cont[:1]) if lookup else None
    planner.begin(q["prefill_s"])
    # the prefill decided cont[0], the first cycle's root; every cycle's root is the last token produced
    pos, behind, seconds = min(1, len(cont)), len(prompt), q["prefill_s"]
    plain = q["prefill_s"] + sum(costs.verify(0, len(prompt) + k) for k in range(len(cont) - 1))
    while pos < len(cont):
        context = len(prompt) + pos - 1  # the cache: the prompt and every token produced but the root
        want = cont[pos:]  # what the target produces after this cycle's root
        levels, head = 0, []  # head: the verified candidates as (token, parent: 0 the root, i the i-th of them)
        catchup = behind
        plan = planner.plan(context, behind)
        if behind > 0 and plan.draft:
            tokens, parents, scores, depth = (np.array(x) for x in q["drafts"][pos - 1])
            levels = 1
            while levels < depth.max() and plan.keep_drafting(_frontier(scores, parents, depth, levels)):
                levels += 1
            m = int((depth <= levels).sum())  # the levels drafted: a prefix (parents come first)
            tokens, parents, scores, depth = tokens[:m], parents[:m], scores[:m], depth[:m]
            planner.observe_levels([(_frontier(scores, parents, depth, d).numpy(), scores[depth == d + 1][None])
                                    for d in range(1, levels)], context)
            n = plan.choose(torch.tensor(scores)[None], levels)
            chosen = sorted(np.argsort(-scores, kind="stable")[:n].tolist())  # Candidates.best
            node = {c: k + 1 for k, c in enumerate(chosen)}
            head = [(int(tokens[c]), node.get(int(parents[c]), 0)) for c in chosen]
            _calibrate(planner, tokens, parents, scores, depth, want)
            behind = 0
        chain, ngram = [], 0
        if index is not None:
            found, ngram = index.continuation(lookup)
            if ngram:
                chain = found[: plan.lookup_sizes(len(head))[ngram - 1]]
        accepted, extra = _accept(head, chain, want)
        gained = min(accepted + 1, len(want))
        if chain:
            planner.observe_lookup([len(chain)], [accepted_prefix(chain, want[:accepted])], [ngram])
        nodes = len(head) + extra
        draft_s, rest_s = costs.draft(levels, catchup), costs.verify(nodes, context)
        planner.observe_cycle(plan, nodes, levels, gained, draft_s, rest_s)
        seconds += draft_s + rest_s
        if index is not None:
            index.extend(want[:gained])
        pos += gained
        behind += gained
    return seconds, plain


def _frontier(scores, parents, depth, d: int):
    """[1, F] scores of the depth-d candidates the drafter expanded (those with children one level down)."""
    import numpy as np
    import torch

    return torch.tensor(scores[np.isin(np.arange(len(scores)), parents[depth == d + 1])])[None]


def _accept(head: list[tuple[int, int]], chain: list[int], want: list[int]) -> tuple[int, int]:
    """(drafts accepted, nodes the lookup chain adds to the head's tree): the tree walked along the target's tokens."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(head, 1):
        children.setdefault(parent, {})[tok] = i
    node, extra = 0, 0
    for t in chain:  # graft: share the head's nodes where the chain agrees, add the rest
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            extra += 1
            nxt = len(head) + extra
            children.setdefault(node, {})[t] = nxt
        node = nxt
    node, accepted = 0, 0
    for t in want:
        node = children.get(node, {}).get(t)
        if node is None:
            break
        accepted += 1
    return accepted, extra


def _calibrate(planner, tokens, parents, scores, depth, want: list[int]) -> None:
    """What the generator tells the planner after a draft: which candidates spelled the target's tokens."""
    import numpy as np
    import torch

    from eyas.inference.tree import DraftTree, on_continuation

    tree = DraftTree(torch.tensor([[0, *tokens.tolist()]]), torch.tensor([[-1, *(parents + 1).tolist()]]),
                     torch.tensor([[0, *depth.tolist()]]), torch.tensor([[0.0, *scores.tolist()]]))
    width = int(depth.max())
    after = torch.tensor([(want + [-1] * width)[:width]])
    on, known = on_continuation(tree, after, torch.tensor([min(len(want), width)]))
    k = known[0, 1:].numpy()
    planner.observe(np.exp(scores[k]), on[0, 1:].numpy()[k])


def run(args: argparse.Namespace) -> None:
    from eyas.inference.costs import CostModel
    from eyas.inference.planner import Planner

    recordings = []
    for path in args.recordings:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            recordings.append(json.load(f))
        if recordings[-1].get("version") != VERSION:
            sys.exit(f"{path}: recorded by an older replay.py (format {recordings[-1].get('version', 1)}, "
                     f"this one reads {VERSION}): record it again")
    costs = truth(recordings)
    print(f"cost model of the recorded cycles: {json.dumps({k: round(v, 5) for k, v in costs.describe().items()})}")
    variants = {k: v for k, v in VARIANTS.items() if not args.variants or k in args.variants}
    for rec, path in zip(recordings, args.recordings):
        live = [q["plain_s"] / q["spec_s"] for q in rec["questions"]]
        print(f"\n{path}: head {rec['head']}, {len(rec['questions'])} questions; live speedup over eyas plain: "
              f"mean {statistics.mean(live):.3f}x, worst {min(live):.3f}x")
        print(f"{'variant':<14} {'mean':>7} {'overall':>8} {'worst':>7} {'p10':>7} {'slower':>7}  worst question")
        for name, kw in variants.items():
            t0 = time.perf_counter()
            # each variant learns this machine from the calibration the recording started from, as it would live
            planner = Planner(CostModel(**rec["start"]), rec["depth"], top_k=rec["top_k"],
                              **{"lookup_max": rec["lookup"], **kw})
            results = [(q, *replay(rec, q, costs, planner)) for q in rec["questions"]]
            speedups = [plain / spec for _, spec, plain in results]
            overall = sum(p for *_, p in results) / sum(s for _, s, _ in results)
            worst = min(range(len(results)), key=speedups.__getitem__)
            p10 = sorted(speedups)[int(0.1 * (len(speedups) - 1))]
            print(f"{name:<14} {statistics.mean(speedups):>6.3f}x {overall:>7.3f}x {speedups[worst]:>6.3f}x "
                  f"{p10:>6.3f}x {100 * sum(x < 1 for x in speedups) / len(speedups):>6.0f}%  "
                  f"{results[worst][0]['question_id']} ({time.perf_counter() - t0:.1f} s)")
            if args.per_question:
                for (q, spec, plain), live_q in zip(results, live):
                    print(f"    {str(q['question_id']):<20} {q['category']:<14} {plain / spec:.3f}x "
                          f"(live {live_q:.3f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="record drafts, continuations and cycle costs of a head on some questions")
    r.add_argument("--target", default="smollm2-135m")
    r.add_argument("--head", required=True, help="head folder, or `random` (an untrained EAGLE-3 head)")
    r.add_argument("--questions", default="mt-bench", help="`mt-bench` or a .jsonl file (eyas bench's format)")
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--per-category", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--depth", type=int, default=6)
    r.add_argument("--top-k", type=int, default=4)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", required=True, help="recording .json.gz")
    r.set_defaults(func=record)
    q = sub.add_parser("run", help="replay planner variants on recordings")
    q.add_argument("recordings", nargs="+")
    # argparse %-formats help texts, and variant names hold "%"
    q.add_argument("--variants", nargs="*", choices=list(VARIANTS),
                   help=f"default: all of {list(VARIANTS)}".replace("%", "%%"))
    q.add_argument("--per-question", action="store_true", help="also print every question's speedup")
    q.set_defaults(func=run)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
