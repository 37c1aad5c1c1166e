"""Benchmark: regeneration throughput vs plain batched `generate`, and free feature capture.

    python benchmarks/bench_regenerate.py [--target smollm2-135m] [--prompts 32] [--max-new-tokens 128]
    python benchmarks/bench_regenerate.py --prompts 64 --batch-size 32 --max-new-tokens 384 --no-capture

Same prompts (first user turn of ShareGPT conversations, rendered with the target's template),
same greedy settings and batch size for every variant:
- generate: `model.generate` over left-padded batches; a batch runs until its longest answer ends.
- regenerate: continuous batching (eyas.data.regenerate), no capture.
- regenerate+states: the same, capturing the EAGLE-3 features and final hidden of every token.
- bare forward: one separate target pass (with the same layer features) over each finished
  example: what extracting the features afterwards would cost.
Useful tokens = generated tokens up to and including the end-of-turn token. Each variant is
reported per wall second and per CPU second of this process (time.process_time): on a machine
shared with other jobs, wall time depends on their load, CPU time much less; with --threads 1
no CPU time is spent by OpenMP threads waiting on each other.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--source", default="sharegpt")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-capture", action="store_true", help="skip the state-capture variants (shorter run)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from eyas.data.regenerate import RegenConfig, regenerate
    from eyas.data.sources import load_conversations
    from eyas.models import Target, default_fused_layer_ids

    target = Target.load(args.target)
    tok = target.tokenizer
    convs, _ = load_conversations(args.source)
    chats: list[list[dict]] = []
    for row in convs:
        m = row["messages"]
        if row["problem"] or m[0]["role"] != "user" or len(m) < 2 or m[1]["role"] != "assistant":
            continue
        text = tok.apply_chat_template(m[:1], tokenize=False, add_generation_prompt=True)
        if len(tok(text, add_special_tokens=False)["input_ids"]) <= args.max_prompt_tokens:
            chats.append(m[:2])
        if len(chats) == args.prompts:
            break
    eos = tok.eos_token_id
    layers = tuple(default_fused_layer_ids(target.num_layers))
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, max_turns=1, max_length=10**6)
    print(f"{args.target}: {len(chats)} prompts, {args.max_new_tokens} new tokens, batch {args.batch_size}, "
          f"greedy, {torch.get_num_threads()} threads, layers {layers}")

    # -- plain batched generate --
    tok.padding_side = "left"
    prompts = [tok.apply_chat_template(c[:1], tokenize=False, add_generation_prompt=True) for c in chats]
    t0, c0, useful = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(prompts), args.batch_size):
        enc = tok(prompts[i: i + args.batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = target.model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            useful += row.index(eos) + 1 if eos in row else len(row)
    plain = useful / (time.perf_counter() - t0)
    plain_cpu = useful / (time.process_time() - c0)
    print(f"generate:            {useful} useful tokens, {plain:8.1f} useful tokens/s, {plain_cpu:8.1f} per CPU-s")

    # -- continuous batching, without and with state capture --
    c0 = time.process_time()
    ours = regenerate(target, enumerate(chats), cfg, args.batch_size, progress=False)
    ours_cpu = ours.useful_tokens / (time.process_time() - c0)
    print(f"regenerate:          {ours.useful_tokens} useful tokens, {ours.tokens_per_s:8.1f} useful tokens/s "
          f"({ours.tokens_per_s / plain:.2f}x generate), {ours_cpu:8.1f} per CPU-s ({ours_cpu / plain_cpu:.2f}x)")
    if args.no_capture:
        return
    jobs = []
    cap = regenerate(target, enumerate(chats), cfg, args.batch_size, layer_ids=layers, on_done=jobs.append,
                     progress=False)
    print(f"regenerate+states:   {cap.useful_tokens} useful tokens, {cap.tokens_per_s:8.1f} useful tokens/s "
          f"({cap.tokens_per_s / plain:.2f}x generate, {cap.tokens_per_s / ours.tokens_per_s:.0%} of no capture); "
          f"states of {cap.state_tokens} tokens")

    # -- what a separate feature pass would cost --
    t0 = time.perf_counter()
    for job in jobs:
        target(torch.tensor([job.prompt + job.generated]), layer_ids=layers, logits=False)
    bare_s = time.perf_counter() - t0
    bare = cap.state_tokens / bare_s
    extra = cap.seconds - ours.seconds
    print(f"bare target forward: {bare:8.1f} tokens/s over the same {cap.state_tokens} tokens ({bare_s:.1f} s)")
    if extra <= 0:  # capture was within run-to-run noise: report that, not a ratio over ~0 s
        print(f"feature capture during generation: no measurable cost ({extra:+.1f} s for {cap.state_tokens} tokens; "
              f"a separate pass would add {bare_s:.1f} s)")
    else:
        print(f"feature capture during generation: +{extra:.1f} s for {cap.state_tokens} tokens = "
              f"{cap.state_tokens / extra:8.1f} feature tokens/s "
              f"({cap.state_tokens / extra / bare:.1f}x the bare forward)")


if __name__ == "__main__":
    main()
