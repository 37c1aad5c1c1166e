"""Training throughput benchmark: `python benchmarks/bench_train.py [--target smollm2-135m]`.

Times one training step of an EAGLE head, as the trainer runs it:
  online   = frozen target forward (features, final hidden states) + head forward/backward over all TTT steps
             (the teacher's logits through the target's own head at the loss rows only) + AdamW
  offline  = the same head step from cached states (features and final hidden states already in memory)
and the ratio head forward+backward / target forward on the same tokens (goal: <= 1).

The head's cost depends on how many positions carry loss (the loss skips the rest), so the batch is
real conversations rendered by the data layer (default: the built-in ShareGPT source, assistant-only
loss mask, right-padded like training batches); `--data random` gives random ids with loss at every
position (the worst case). The output says which batch was used and what fraction carries loss.
Target and head are timed interleaved, repeat by repeat, so a shared machine slows both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _elapsed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _batch(args, target) -> tuple[dict[str, torch.Tensor], str]:
    """-> (input_ids, loss_mask, attention_mask [B, T]), a line describing them."""
    if args.data == "random":
        ids = torch.randint(0, target.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
        ones = torch.ones_like(ids, dtype=torch.bool)
        return {"input_ids": ids, "loss_mask": ones, "attention_mask": ones}, "random ids, loss at every position"
    from eyas.data import build_examples
    from eyas.train.data import ExampleStream, collate

    examples, _ = build_examples(args.data, target.tokenizer, max_length=args.length, limit=16 * args.batch)
    batch = collate(ExampleStream(examples, seed=0).rows(0, args.batch), target.tokenizer.pad_token_id or 0)
    real = batch["attention_mask"].float().mean().item()
    loss = (batch["attention_mask"] & batch["loss_mask"]).float().mean().item()
    return batch, (f"{args.data} (seeded pick of {args.batch} of its first {len(examples)} usable rows, "
                   f"max_length {args.length}): {real:.0%} of positions are real tokens, {loss:.0%} carry loss")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_train.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", choices=["eagle3", "eagle1"], default="eagle3")
    p.add_argument("--data", default="sharegpt",
                   help="conversation source for the batch (a data-layer spec), or `random` (loss everywhere)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=512, help="max tokens per row (random: exactly this many)")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192, help="eagle3 draft vocabulary size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); use 1 on a shared machine")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from eyas.models import DraftHead, Target, head_config_for
    from eyas.train.config import LossConfig
    from eyas.train.losses import DistillationLoss, target_teacher

    target = Target.load(args.target)
    eagle3 = args.head == "eagle3"
    config = head_config_for(target, args.head, draft_vocab_size=args.draft_vocab if eagle3 else None)
    head = DraftHead(config, target)
    model = DistillationLoss(head, LossConfig(ttt_steps=args.ttt_steps))
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
    torch.manual_seed(0)
    batch, described = _batch(args, target)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    valid = mask & batch["loss_mask"]
    tokens = ids.numel()

    def target_forward():
        return target(ids, padding_mask=mask, layer_ids=config.fused_layer_ids, logits=False)

    out = target_forward()
    states = out.features if eagle3 else out.hidden
    hidden = out.hidden.to(torch.bfloat16)  # what the offline cache stores

    def head_fwd_bwd():
        loss, _ = model(ids, valid, states, target_teacher(target, out.hidden))
        loss.backward()
        head.zero_grad()

    def head_step(states, hidden):
        loss, _ = model(ids, valid, states, target_teacher(target, hidden))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def online():
        o = target_forward()
        head_step(o.features if eagle3 else o.hidden, o.hidden)

    def offline():
        head_step(states, hidden)

    variants = {"target": target_forward, "head": head_fwd_bwd, "online": online, "offline": offline}
    for fn in variants.values():
        fn()  # warm-up (allocator, lazy init)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for k, fn in variants.items():
            times[k].append(_elapsed(fn))
    t = {k: statistics.median(v) for k, v in times.items()}
    ratio = statistics.median(h / g for h, g in zip(times["head"], times["target"]))
    steps = args.ttt_steps if eagle3 else 1
    print(f"target {args.target}, {args.head} head ({sum(p.numel() for p in head.parameters()) / 1e6:.1f}M params, "
          f"draft vocab {config.draft_vocab_size}, {steps} TTT step(s)), batch {tuple(ids.shape)} tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved repeats")
    print(f"batch: {described}")
    print(f"target forward            {t['target'] * 1e3:8.0f} ms  {tokens / t['target']:8.0f} tokens/s")
    print(f"head fwd+bwd (all steps)  {t['head'] * 1e3:8.0f} ms  = {ratio:.2f} x target forward "
          "(median per-repeat ratio)")
    print(f"train step online         {t['online'] * 1e3:8.0f} ms  {tokens / t['online']:8.0f} tokens/s")
    print(f"train step offline        {t['offline'] * 1e3:8.0f} ms  {tokens / t['offline']:8.0f} tokens/s")


if __name__ == "__main__":
    main()
