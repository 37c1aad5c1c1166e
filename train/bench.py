"""Training throughput benchmark (not a test): `python -m eyas.train.bench [--target smollm2-135m]`.

Times, on random token ids (cost does not depend on content), one training step of an EAGLE head:
  online   = frozen target forward (features + logits) + head forward/backward over all TTT steps + AdamW
  offline  = lm_head over cached final hidden states + the same head step (features already in memory)
and the ratio head forward+backward / target forward on the same tokens (goal: <= 1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, lazy init)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eyas.train.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--head", choices=["eagle3", "eagle1"], default="eagle3")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192, help="eagle3 draft vocabulary size")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from eyas.models import DraftHead, Target, head_config_for
    from eyas.train.config import LossConfig
    from eyas.train.losses import DistillationLoss

    target = Target.load(args.target)
    eagle3 = args.head == "eagle3"
    config = head_config_for(target, args.head, draft_vocab_size=args.draft_vocab if eagle3 else None)
    head = DraftHead(config, target)
    model = DistillationLoss(head, LossConfig(ttt_steps=args.ttt_steps))
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.batch, args.length))
    valid = torch.ones_like(ids, dtype=torch.bool)
    tokens = ids.numel()

    def target_forward():
        return target(ids, layer_ids=config.fused_layer_ids)

    out = target_forward()
    states = out.features if eagle3 else out.hidden
    hidden = out.hidden.to(torch.bfloat16)  # what the offline cache stores

    def head_fwd_bwd():
        loss, _ = model(ids, valid, states, out.logits)
        loss.backward()

    def head_step(states, logits):
        loss, _ = model(ids, valid, states, logits)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def online():
        o = target_forward()
        head_step(o.features if eagle3 else o.hidden, o.logits)

    def offline():
        with torch.no_grad():
            logits = target.lm_head(hidden.to(target.dtype))
        head_step(states, logits)

    t_target = _time(target_forward, args.repeats)
    t_head = _time(head_fwd_bwd, args.repeats)
    optimizer.zero_grad()
    t_online = _time(online, args.repeats)
    t_offline = _time(offline, args.repeats)
    steps = args.ttt_steps if eagle3 else 1
    print(f"target {args.target}, {args.head} head ({sum(p.numel() for p in head.parameters()) / 1e6:.1f}M params, "
          f"draft vocab {config.draft_vocab_size}, {steps} TTT step(s)), batch {args.batch} x {args.length} tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"target forward            {t_target * 1e3:8.0f} ms  {tokens / t_target:8.0f} tokens/s")
    print(f"head fwd+bwd (all steps)  {t_head * 1e3:8.0f} ms  = {t_head / t_target:.2f} x target forward")
    print(f"train step online         {t_online * 1e3:8.0f} ms  {tokens / t_online:8.0f} tokens/s")
    print(f"train step offline        {t_offline * 1e3:8.0f} ms  {tokens / t_offline:8.0f} tokens/s")


if __name__ == "__main__":
    main()
