"""What a GPU user runs first: eyas's paths on one GPU, each checked, in one command (<= 10 minutes on one GPU).

    python benchmarks/gpu_smoke.py                 # on a machine with a CUDA GPU
    python benchmarks/gpu_smoke.py --cpu-dry-run   # the same checks on the CPU at tiny sizes (that the script works)

1. greedy identity: speculative greedy output equals the target's own `generate`, batch 1 and 3, chain, static and
   dynamic trees (tiny random targets, fp32 without TF32: the setting where identity is exact);
2. seeded sampling: the same seed gives the same sample, batch 1 and 3;
3. regeneration at temperature 0 (answers equal the target's greedy ones) and 0.7 (seeded: reproducible), with the
   hidden-state cache written while generating;
4. cache-hidden on the device: the stored states equal a CPU fp32 forward (bf16 storage);
5. a short bf16 training run interrupted and resumed: the resumed losses equal an uninterrupted run's;
6. one training step of a random Llama-3.1-8B-shaped target (online, bf16) at 2048 and 4096 tokens: peak memory
   (torch.cuda.max_memory_allocated) against eyas.models.memory's prediction;
7. one speculative generation of that target: draft / target / overhead time per cycle and host syncs counted
   (torch.cuda.set_sync_debug_mode);
8. compiled decode steps of fixed shapes (CUDA graphs on a GPU): greedy identity, no graph recompiled or skipped,
   and a Llama-3.2-1B-shaped target's plain step and 16- and 64-token verifies, eager vs compiled.
Every line says PASS or FAIL; the exit status is the number of failures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.helpers (tiny models)
sys.path.insert(0, str(REPO / "benchmarks"))  # memory.py (random targets shaped like real ones)

import memory as bench_memory  # noqa: E402

from tests.helpers.tiny import tiny_model, tiny_tokenizer  # noqa: E402

GiB = 2**30
# the dry run's stand-in for the real-shaped targets
TINY_SHAPED = bench_memory.llama(256, 688, 4, 4, 2, 4096, False, name="tiny-llama-shaped")
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


class Context:
    def __init__(self, device: torch.device, dry: bool, work: Path) -> None:
        self.device, self.dry, self.work = device, dry, work

    def tiny_target(self, arch="llama", tied=False, dtype=torch.float32):
        from eyas.models import Target

        return Target(tiny_model(arch, tied).to(self.device, dtype), tiny_tokenizer(), f"tiny-{arch}")

    def head(self, target, seed=0):
        from eyas.models import DraftHead, head_config_for

        torch.manual_seed(seed)
        head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=120), target)
        head.set_vocab_map(torch.randperm(target.vocab_size)[:120])
        return head.to(target.device, target.dtype)


def own_greedy(target, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                min_new_tokens=n, pad_token_id=1)
    return out[0, len(prompt):].tolist()


PROMPTS = [list(range(10, 22)), [40, 41, 7], list(range(100, 131, 2))]


@check
def greedy_identity(ctx: Context) -> str:
    from eyas.inference import SpeculativeGenerator, TreeOptions

    torch.backends.cuda.matmul.allow_tf32 = False  # identity is exact in fp32; TF32 rounds differently per shape
    results = []
    for arch in ("llama", "qwen3"):
        target = ctx.tiny_target(arch)
        refs = [own_greedy(target, p, 24) for p in PROMPTS]
        for options in (TreeOptions(kind="chain", depth=4), TreeOptions(kind="static"),
                        TreeOptions(total_tokens=16, top_k=4, depth=5)):
            for batch in (1, 3):
                gen = SpeculativeGenerator(target, ctx.head(target), options)
                got = gen.generate_batch(PROMPTS[:batch], max_new_tokens=24, eos_token_id=[])
                bad = [i for i, r in enumerate(got) if r.tokens != refs[i]]
                assert not bad, f"{arch} {options.kind} batch {batch}: rows {bad} differ from the target's generate"
                results.append(f"{arch}/{options.kind}/b{batch}")
    torch.backends.cuda.matmul.allow_tf32 = True
    return f"{len(results)} cases identical ({', '.join(results[:4])}, ...)"


@check
def seeded_sampling(ctx: Context) -> str:
    from eyas.inference import SpeculativeGenerator, TreeOptions

    target = ctx.tiny_target("llama")
    gen = SpeculativeGenerator(target, ctx.head(target), TreeOptions(total_tokens=16))
    for batch in (1, 3):
        runs = [[r.tokens for r in gen.generate_batch(PROMPTS[:batch], max_new_tokens=24, temperature=0.8,
                                                      top_p=0.95, seed=seed, eos_token_id=[])] for seed in (7, 7, 8)]
        assert runs[0] == runs[1], f"batch {batch}: the same seed gave different samples"
        assert runs[0] != runs[2], f"batch {batch}: seeds 7 and 8 gave the same samples"
    return "same seed -> same tokens, other seed -> other tokens (batch 1 and 3)"


def _conversations():
    import datasets

    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(6):
        words = " ".join(f"w{int(x)}" for x in torch.randint(60, 250, (3 + i,), generator=g))
        rows.append([{"role": "user", "content": words}, {"role": "assistant", "content": "w1"}])
    return datasets.Dataset.from_dict({"messages": rows, "problem": [""] * len(rows)})


@check
def regenerate(ctx: Context) -> str:
    from eyas.data.hidden_cache import HiddenStateDataset
    from eyas.data.regen_store import regenerate_jsonl
    from eyas.data.regenerate import RegenConfig, next_prompt

    target = ctx.tiny_target("llama")
    ds = _conversations()
    outs = {}
    for name, temp in (("greedy", 0.0), ("sampled-a", 0.7), ("sampled-b", 0.7)):
        out = ctx.work / f"regen-{name}.jsonl"
        regenerate_jsonl(target, ds, out, RegenConfig(max_new_tokens=10, temperature=temp, seed=3), batch_size=3,
                         progress=False, eos_ids=[], cache_hidden=ctx.work / f"regen-{name}-hidden")
        outs[name] = {json.loads(x)["id"]: json.loads(x)["messages"] for x in out.read_text().splitlines()}
        assert len(HiddenStateDataset(ctx.work / f"regen-{name}-hidden", target)) == len(ds)
    from eyas.data.regenerate import Job

    tok = target.tokenizer
    for i, conv in enumerate(ds["messages"]):
        prompt = next_prompt(Job(i, conv), tok, RegenConfig())
        want = tok.decode(own_greedy(target, prompt, 10), skip_special_tokens=True)
        assert outs["greedy"][i][-1]["content"] == want, f"conversation {i}: greedy answer differs from generate"
    assert outs["sampled-a"] == outs["sampled-b"], "seeded sampling at 0.7 is not reproducible"
    assert outs["sampled-a"] != outs["greedy"], "temperature 0.7 gave the greedy answers"
    return f"{len(ds)} conversations: greedy = the target's generate; 0.7 reproducible per seed; caches readable"


@check
def cache_hidden(ctx: Context) -> str:
    import datasets

    from eyas.data.hidden_cache import HiddenStateDataset
    from eyas.data.hidden_cache import cache_hidden as write_cache

    target = ctx.tiny_target("llama", dtype=torch.bfloat16 if ctx.device.type == "cuda" else torch.float32)
    reference = ctx.tiny_target("llama").to("cpu")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 300, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (9,), generator=g)]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows]})
    layers = (1, 2, 4)
    write_cache(target, ds, ctx.work / "hidden", layers, dtype="bf16", batch_size=4, shard_examples=4)
    cached = HiddenStateDataset(ctx.work / "hidden", target)
    worst = 0.0
    for i, r in enumerate(rows):
        out = reference(torch.tensor([r]), layer_ids=layers, logits=False)
        got = cached[i]["features"].float()
        worst = max(worst, float((got - out.features[0]).abs().max() / out.features[0].abs().max()))
    assert worst < 0.05, f"cached features differ from a CPU fp32 forward by {worst:.3f} (relative)"
    return f"{len(rows)} examples, target in {target.dtype} on {target.device}: max relative error {worst:.4f}"


@check
def bf16_training_resume(ctx: Context) -> str:
    from eyas.train.losses import DistillationLoss
    from eyas.train.trainer import run
    from tests.helpers.train import reset_accelerate, tiny_run_config

    os.environ["EYAS_CACHE"] = str(ctx.work / "cache")
    common = ["schedule.total_steps=6", "checkpoint.every=3", "logging.eval_batches=0", "loss.feature_noise=0.2"]
    if ctx.device.type == "cuda":
        common += ["precision=bf16", "target.dtype=bf16"]

    def losses(folder):
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        return [r["train/loss"] for r in rows if "train/loss" in r]

    run(tiny_run_config(ctx.work / "train" / "straight", *common))
    reset_accelerate()
    forward, calls = DistillationLoss.forward, {"n": 0}

    def interrupted(self, *a):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return forward(self, *a)

    DistillationLoss.forward = interrupted
    try:
        assert run(tiny_run_config(ctx.work / "train" / "resumed", *common)) == {}
    finally:
        DistillationLoss.forward = forward
    reset_accelerate()
    run(tiny_run_config(ctx.work / "train" / "resumed", *common))
    reset_accelerate()
    a, b = losses(ctx.work / "train" / "straight"), losses(ctx.work / "train" / "resumed")
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert len(a) == len(b) == 6 and worst < 5e-3, f"resumed losses differ by {worst:.2e}: {a} vs {b}"
    return f"stopped at step 2, resumed to 6: losses within {worst:.1e} of the uninterrupted run ({a[-1]:.4f})"


def _shapes(ctx: Context):
    """(target config, sequence lengths) of the memory checks: 8B-shaped on a GPU, tiny on the CPU."""
    if ctx.dry:
        return TINY_SHAPED, (256, 512)
    return bench_memory.LLAMA_3_1_8B, (2048, 4096)


def _train_step_peak(ctx: Context, config, t: int, precision: str) -> tuple[int, float]:
    """(peak bytes, seconds) of the second optimizer step of an online training step over one sequence of t tokens
    (its second half carrying loss) of a zero-weight target of `config`, built inside the measurement."""
    from eyas.models import DraftHead, head_config_for
    from eyas.train.config import LossConfig
    from eyas.train.losses import DistillationLoss, target_teacher

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with bench_memory.measured(ctx.device, skip_matmuls=False) as m:
        target = bench_memory.zero_target(config, ctx.device, dtype)
        head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=min(32000, target.vocab_size)),
                         target).to(ctx.device)
        loss_fn = DistillationLoss(head, LossConfig(ttt_steps=7))
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
        ids = torch.randint(0, target.vocab_size, (1, t), device=ctx.device)
        valid = torch.zeros(1, t, dtype=torch.bool, device=ctx.device)
        valid[:, t // 2:] = True

        def step():
            out = target(ids, layer_ids=head.config.fused_layer_ids, logits=False)
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss, _ = loss_fn(ids, valid, out.features, target_teacher(target, out.hidden))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # AdamW's state exists from here on
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            m["tracker"].reset_peak()
        start = time.perf_counter()
        step()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return m["peak"], seconds


@check
def training_step_memory(ctx: Context) -> str:
    from eyas.models import memory as estimator

    config, lengths = _shapes(ctx)
    precision = "bf16" if ctx.device.type == "cuda" else "fp32"
    lines = []
    for t in lengths:
        peak, seconds = _train_step_peak(ctx, config, t, precision)
        predicted = estimator.training_step(config, t, precision=precision, target_dtype=precision).total
        lines.append(f"T={t}: measured {peak / GiB:.2f} GiB, predicted {predicted / GiB:.2f} GiB "
                     f"(x{predicted / peak:.2f}), step {seconds:.2f} s")
        assert 0.7 < predicted / peak < 1.3, lines[-1]
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return f"{config.name_or_path}, online, {precision}: " + "; ".join(lines)


@check
def cycle_split(ctx: Context) -> str:
    from eyas.inference import GenerationStats, SpeculativeGenerator, TreeOptions
    from eyas.models import DraftHead, head_config_for

    config, _ = _shapes(ctx)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    target = bench_memory.zero_target(config, ctx.device, dtype)
    target.tokenizer = bench_memory.word_tokenizer(target.vocab_size)
    head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=min(32000, target.vocab_size)),
                     target).to(ctx.device, dtype)
    gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens=32, top_k=8, depth=6, lookup=0))
    prompt = torch.randint(0, target.vocab_size, (512,)).tolist()
    gen.generate(prompt, max_new_tokens=8)  # warm-up (kernels, allocator)
    stats = GenerationStats()
    syncs = "n/a on a CPU"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ctx.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            res = gen.generate(prompt, max_new_tokens=64, eos_token_id=[])
        finally:
            if ctx.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    stats = res.stats
    cycles = max(1, len(stats.accepted))
    if ctx.device.type == "cuda":
        n = sum("synchroniz" in str(w.message) for w in caught)
        syncs = f"{n / cycles:.1f} per cycle ({n} in {cycles} cycles, prefill included)"
    decode = stats.total_time_s - stats.prefill_time_s
    target_decode = stats.target_time_s - stats.prefill_time_s
    overhead = decode - stats.draft_time_s - target_decode
    return (f"{config.name_or_path} {dtype}, 512-token prompt, 64 new tokens in {cycles} cycles: per cycle draft "
            f"{1e3 * stats.draft_time_s / cycles:.1f} ms, target {1e3 * target_decode / cycles:.1f} ms, overhead "
            f"{1e3 * overhead / cycles:.1f} ms; host syncs {syncs}")


def _step_ms(target, context: int, sizes: tuple[int, ...], repeats: int) -> dict[int, float]:
    """ms of one target forward over k new tokens (a chain, every row's logits) after `context` cached tokens, per k:
    the first calls compile (and capture), the median of `repeats` timed ones counts."""
    from eyas.inference.timing import synchronize
    from eyas.models.masks import after_history, causal

    dev = target.device
    cache = target.new_cache(1, context + max(sizes))
    target(torch.randint(0, 1000, (1, context), device=dev), cache=cache, logits=False)
    cache.commit([context])
    times = {}
    for k in sizes:
        ids, pos = torch.randint(0, 1000, (1, k), device=dev), torch.arange(context, context + k, device=dev)[None]
        allowed = after_history(cache.lengths, causal(k, dev)[None], context + k)
        runs = []
        for _ in range(3 + repeats):
            synchronize(dev)
            t0 = time.perf_counter()
            target(ids, pos, cache, allowed)
            synchronize(dev)
            runs.append(time.perf_counter() - t0)
            cache.rollback()
        times[k] = 1e3 * sorted(runs[3:])[repeats // 2]
    return times


@check
def compiled_steps(ctx: Context) -> str:
    """Compiled decode steps (`Target(compile=True)`; fixed shapes by default on a GPU, each captured as a CUDA graph):
    greedy identity on a tiny target, no graph skipped by CUDA graphs, no new graph at other context lengths; then a
    Llama-3.2-1B-shaped bf16 target's plain step and 16- and 64-token verifies over 512 cached tokens, eager vs
    compiled."""
    from torch._dynamo.utils import counters

    from eyas.inference import SpeculativeGenerator, TreeOptions
    from eyas.inference.bench import plain_decode
    from eyas.models import Target
    from eyas.models.sampling import Sampling

    torch.backends.cuda.matmul.allow_tf32 = False
    eager = ctx.tiny_target("llama")
    compiled = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True, fixed_shapes=True)
    head = ctx.head(eager)
    refs = [own_greedy(eager, p, 24) for p in PROMPTS]
    gen = SpeculativeGenerator(compiled, head, TreeOptions(total_tokens=16, top_k=4, depth=5))
    def both(prompt: list[int]) -> list[list[int]]:  # speculative and plain greedy tokens
        return [gen.generate(prompt, max_new_tokens=24, eos_token_id=[]).tokens,
                plain_decode(compiled, prompt, 24, [], Sampling(0.0), 0)]

    got = both(PROMPTS[0])  # warms the graphs up
    graphs = counters["stats"]["unique_graphs"]
    got += [tokens for p in PROMPTS[1:] for tokens in both(p)]
    assert got == [r for r in refs for _ in range(2)], "compiled decode steps changed greedy output"
    new = counters["stats"]["unique_graphs"] - graphs
    assert new == 0, f"{new} new graphs at other context lengths: the steps' shapes follow the context"
    skips = counters["inductor"]["cudagraph_skips"]
    assert not skips, f"CUDA graphs skipped {skips} graphs (see the log's 'skipping cudagraphs' lines)"
    torch.backends.cuda.matmul.allow_tf32 = True

    config = TINY_SHAPED if ctx.dry else bench_memory.LLAMA_3_2_1B
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    big = bench_memory.zero_target(config, ctx.device, dtype)
    weights = sum(p.numel() * p.element_size() for p in big.model.parameters())
    sizes, lines = (1, 16, 64), {}
    for name, target in (("eager", big), ("compiled", Target(big.model, None, big.name_or_path, cpu_kernels=False,
                                                             compile=True, fixed_shapes=True))):
        lines[name] = _step_ms(target, 512, sizes, repeats=5 if ctx.dry else 50)
    speed = " ".join(f"k={k} {lines['eager'][k]:.2f} -> {lines['compiled'][k]:.2f} ms" for k in sizes)
    return (f"greedy identical, nothing recompiled or skipped; {config.name_or_path} {dtype} eager -> compiled: "
            f"{speed}; the step reads its {weights / 1e9:.2f} GB of weights at "
            f"{weights / lines['compiled'][1] / 1e6:.0f} GB/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_smoke.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-dry-run", action="store_true", help="run every check on the CPU at tiny sizes")
    p.add_argument("--only", nargs="*", default=None, help="run only these checks")
    a = p.parse_args(argv)
    if not a.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA GPU visible: run with --cpu-dry-run to check the script itself", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.cpu_dry_run else "cuda")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / GiB:.0f}"
              f" GiB), torch {torch.__version__}")
    failures, start = 0, time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eyas-gpu-smoke-") as work:
        ctx = Context(device, a.cpu_dry_run, Path(work))
        for fn in CHECKS:
            if a.only and fn.__name__ not in a.only:
                continue
            t0 = time.perf_counter()
            try:
                line = f"PASS {fn.__name__}: {fn(ctx)}"
            except Exception as e:  # noqa: BLE001 - every check reports, the run goes on
                failures += 1
                line = f"FAIL {fn.__name__}: {type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stderr)
            print(f"{line} [{time.perf_counter() - t0:.1f} s]", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"{len(CHECKS) - failures if not a.only else len(a.only) - failures} passed, {failures} failed in "
          f"{time.perf_counter() - start:.0f} s on {device}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
