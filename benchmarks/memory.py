"""Predicted (eyas.models.memory) and measured peak memory of a training step and of speculative generation.

    python benchmarks/memory.py                      # CPU: Llama-3.2-1B-shaped target at 2048 and 4096 tokens
    python benchmarks/memory.py --device cuda        # the same measured with torch.cuda.max_memory_allocated

Targets are random, built from a config on the meta device and filled with zeros: no weights are downloaded.
Measured = the peak of live tensor bytes during the step (every storage created, minus those freed: what a GPU's
max_memory_allocated reports), also shown as the growth of the process's peak resident memory. On a CPU the
matrix products and attention kernels are replaced by uncomputed outputs of their shapes (`--real-compute`
runs them): the step allocates exactly what it allocates for real, but a 4096-token step of a 1B-shaped model
takes seconds instead of half an hour on 2 cores. The training step is offline (the states come from a cache:
embedding and lm_head loaded, decoder layers not), fp32, one sequence whose second half carries loss, 7 TTT
steps, a 32k draft vocabulary; it is the second optimizer step (AdamW's state exists), so the peak is that of
every later step. Then the estimator's predictions for Llama-3.1-8B on one 80 GB GPU and 70B on 8 x 80 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

GiB = 2**30
aten = torch.ops.aten
# the kernels whose FLOPs dominate: skipped (uncomputed outputs of the right shape) unless --real-compute
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default}


def llama(hidden, intermediate, layers, heads, kv_heads, vocab, tied, theta=500000.0, name=""):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         vocab_size=vocab, tie_word_embeddings=tied, rope_theta=theta, max_position_embeddings=131072)
    config.name_or_path = name
    return config


# Published shapes (config.json of each model); the weights are never needed.
LLAMA_3_2_1B = llama(2048, 8192, 16, 32, 8, 128256, True, name="Llama-3.2-1B-shaped")
LLAMA_3_1_8B = llama(4096, 14336, 32, 32, 8, 128256, False, name="Llama-3.1-8B-shaped")
LLAMA_3_1_70B = llama(8192, 28672, 80, 64, 8, 128256, False, name="Llama-3.1-70B-shaped")


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while active (freed ones subtracted as they die);
    with skip_matmuls, the ops in MATMULS return uncomputed tensors of their output shapes instead."""

    def __init__(self, skip_matmuls: bool = False) -> None:
        super().__init__()
        self.skip = skip_matmuls
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.skip and func in MATMULS:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            device = next(x.device for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor))
            out = tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)
                           if isinstance(m, torch.Tensor) else m, meta)
        else:
            out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                # opaque tensors (oneDNN-prepacked weights) have no storage: the tensor itself is what lives
                st = t.untyped_storage() if t.layout == torch.strided else t
                key = id(st)
                nbytes = st.nbytes() if st is not t else t.numel() * t.element_size()
                if key not in self._refs and nbytes:
                    self._refs[key] = weakref.ref(st, lambda _, k=key, n=nbytes: self._free(k, n))
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
        return out


def _to_meta(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@contextlib.contextmanager
def measured(device: torch.device, skip_matmuls: bool):
    """Yields a dict that gets `peak` (bytes) after the block: TensorMemory on a CPU, the CUDA allocator's peak on a
    GPU. Objects meant to count must be created inside (weights, optimizer state, inputs)."""
    result = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device)
    else:
        with TensorMemory(skip_matmuls) as tm:
            result["tracker"] = tm
            yield result
        result["peak"] = tm.peak


def zero_target(config, device, dtype, decoder: bool = True):
    """A Target of `config` whose weights are zeros on `device` (decoder=False: its layers stay on the meta device,
    as offline training loads it). Built with the parameters on the meta device and the buffers (RoPE frequencies)
    computed as the model computes them."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from eyas.models import Target

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    target = Target(model, None, config.name_or_path, cpu_kernels=False)
    skip = set() if decoder else {id(p) for p in target._layers.parameters()}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in skip:
                module._parameters[name] = torch.nn.Parameter(torch.zeros(p.shape, dtype=dtype, device=device),
                                                              requires_grad=False)
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = buf.to(device)
    model.tie_weights()
    return target


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of `vocab_size` ids (tests/helpers/tiny.py), for random targets."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.tiny import tiny_tokenizer

    return tiny_tokenizer(vocab_size)


def training_step(config, seq_len: int, device, skip_matmuls: bool, ttt_steps: int = 7, draft_vocab: int = 32000,
                  loss_fraction: float = 0.5) -> dict:
    """Measure an offline fp32 training step's peak (its second optimizer step): {peak, fixed, seconds, rss}."""
    from eyas.models import DraftHead, head_config_for
    from eyas.train.config import LossConfig
    from eyas.train.losses import DistillationLoss, target_teacher

    rss_before = rss_gib()
    with measured(device, skip_matmuls) as m:
        target = zero_target(config, device, torch.float32, decoder=False)
        head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=draft_vocab), target).to(device)
        loss_fn = DistillationLoss(head, LossConfig(ttt_steps=ttt_steps))
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, target.vocab_size, (1, seq_len), generator=gen).to(device)
        valid = torch.zeros(1, seq_len, dtype=torch.bool, device=device)
        valid[:, seq_len - round(loss_fraction * seq_len):] = True
        h = target.hidden_size
        features = torch.randn(1, seq_len, 3 * h, generator=gen).to(device)
        hidden = torch.randn(1, seq_len, h, generator=gen).to(device)
        def step():
            loss, _ = loss_fn(ids, valid, features, target_teacher(target, hidden))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # AdamW's state exists from here on
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            fixed = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            fixed = m["tracker"].live
            m["tracker"].reset_peak()
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return {"peak": m["peak"], "fixed": fixed, "seconds": seconds, "rss": rss_gib() - rss_before}


def speculative_generation(config, context: int, device, skip_matmuls: bool, new_tokens: int = 16) -> dict:
    """Measure greedy speculative generation of `new_tokens` after a prompt of `context - new_tokens` tokens."""
    from eyas.inference import SpeculativeGenerator, TreeOptions
    from eyas.models import DraftHead, head_config_for

    rss_before = rss_gib()
    with measured(device, skip_matmuls) as m:
        target = zero_target(config, device, torch.float32)
        target.tokenizer = word_tokenizer(target.vocab_size)  # the answer's text is decoded
        head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=32000), target).to(device)
        gen = SpeculativeGenerator(target, head, TreeOptions(total_tokens=64, top_k=8, depth=6, lookup=0))
        prompt = torch.randint(0, target.vocab_size, (context - new_tokens,)).tolist()
        start = time.perf_counter()
        gen.generate(prompt, max_new_tokens=new_tokens, temperature=0.0)
        seconds = time.perf_counter() - start
    return {"peak": m["peak"], "seconds": seconds, "rss": rss_gib() - rss_before}


def isolated(kind: str, *args) -> dict:
    """Run one measurement in a fresh process (its own peak resident memory; glibc returning freed memory at once)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, __file__, "--measure", kind, *map(str, args)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"measurement {kind} {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure(kind: str, size: str, device: str, skip: str, threads: str) -> None:
    import json

    if kind.startswith("load-"):  # one rank of a sharded load under torchrun: size is the target folder
        return _load_rank(kind.removeprefix("load-"), size)

    if int(threads):
        torch.set_num_threads(int(threads))
    fn = training_step if kind == "train" else speculative_generation
    print(json.dumps(fn(LLAMA_3_2_1B, int(size), torch.device(device), skip == "1")))


def _status_mib(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _load_rank(placement: str, folder: str) -> None:
    """Load the target in `folder` as one rank of a 2-process gloo group would for `placement`; report what it holds
    and how much its peak resident memory grew while loading (JSON, beside the target)."""
    import json
    import os

    import torch.distributed as dist

    from eyas.models.loading import load_model_and_tokenizer
    from eyas.models.target import Target
    from eyas.train import target_sharding as ts

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    before = rss_gib() * 1024
    if placement == "shard":
        model, tok, name = load_model_and_tokenizer(folder, torch.float32, distributed=ts.fsdp_config(folder, world,
                                                                                                     world))
    else:
        model, tok, name = load_model_and_tokenizer(folder, torch.float32, device="cpu")
    target = Target(model, tok, name)
    held, total = ts.held_parameters(target)
    with torch.no_grad():  # read what this rank holds (memory-mapped weights become resident only when read)
        for p in target.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).float().sum()
    out = {"rank": dist.get_rank(), "held": held * 4, "total": total * 4, "peak_growth": rss_gib() * 1024 - before,
           "anon": _status_mib("RssAnon"), "file": _status_mib("RssFile")}
    with open(Path(folder) / f"report-{placement}-{dist.get_rank()}.json", "w") as f:  # ranks' stdout interleaves
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo can abort at interpreter exit (see the notes on distributed training on CPU)


def sharded_load() -> None:
    """Each of 2 CPU processes (gloo) loads a ~600 MB fp32 target for each placement: what it holds and its peak
    resident memory growth while loading."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from transformers import AutoModelForCausalLM

    config = llama(1024, 2816, 8, 16, 4, 32000, False, name="mid-llama")
    with tempfile.TemporaryDirectory(prefix="eyas-sharded-load-") as folder:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        word_tokenizer(32000).save_pretrained(folder)
        print("sharded loading, 2 CPU processes (gloo), fp32 target of "
              f"{sum(f.stat().st_size for f in Path(folder).glob('*.safetensors')) / 2**20:.0f} MiB on disk")
        print(f"{'placement':<10} {'rank':>4} {'holds MiB':>10} {'of MiB':>8} {'peak RSS growth':>16} {'anon MiB':>9}"
              f" {'file-backed MiB':>16}")
        for placement in ("replicate", "shard"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(29500 + os.getpid() % 1000), __file__, "--measure", f"load-{placement}", folder, "cpu", "0", "0"]
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                   "MALLOC_MMAP_THRESHOLD_": "131072"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            rows = [json.loads(p.read_text()) for p in sorted(Path(folder).glob(f"report-{placement}-*.json"))]
            if len(rows) != 2:
                print(f"{placement:<10} failed: {proc.stderr[-1500:]}")
                continue
            for r in rows:
                print(f"{placement:<10} {r['rank']:>4} {r['held'] / 2**20:>10.0f} {r['total'] / 2**20:>8.0f} "
                      f"{r['peak_growth']:>15.0f}M {r['anon']:>9.0f} {r['file']:>16.0f}")


SETUPS = [  # (label, training_step keyword arguments)
    ("1 GPU", dict(processes=1)),
    ("8 GPUs DDP", dict(processes=8, head_sharding="ddp")),
    ("8 GPUs FSDP2", dict(processes=8, placement="shard", head_sharding="fsdp")),
    ("8 GPUs ZeRO-3", dict(processes=8, placement="shard", head_sharding="zero3")),
    ("1 GPU offline", dict(processes=1, offline=True)),
]


def fits_table() -> None:
    """Predicted peak GiB per GPU of a training step (bf16, batch 1, 7 TTT steps, 32k draft vocab) and of
    speculative generation of one row, for Llama-3-shaped targets."""
    from eyas.models import memory

    lengths = (2048, 4096, 8192)
    print("training step, peak GiB per GPU (bf16, 1 sequence per GPU, half of it loss tokens, 7 TTT steps, "
          "32k draft vocab)")
    print(f"{'target':<22} {'setup':<15}" + "".join(f" {f'T={t}':>8}" for t in lengths))
    for config in (LLAMA_3_2_1B, LLAMA_3_1_8B, LLAMA_3_1_70B):
        for label, kw in SETUPS:
            row = [memory.training_step(config, t, **kw).total / GiB for t in lengths]
            print(f"{config.name_or_path:<22} {label:<15}" + "".join(f" {x:>8.1f}" for x in row))
    print("\nspeculative generation, one row, peak GiB (bf16 target and head, 64-token verify)")
    print(f"{'target':<22}" + "".join(f" {f'ctx={t}':>9}" for t in lengths))
    for config in (LLAMA_3_2_1B, LLAMA_3_1_8B, LLAMA_3_1_70B):
        row = [memory.speculative_cycle(config, context=t).total / GiB for t in lengths]
        print(f"{config.name_or_path:<22}" + "".join(f" {x:>9.1f}" for x in row))


def main(argv: list[str] | None = None) -> None:
    from eyas.models import memory

    p = argparse.ArgumentParser(prog="python benchmarks/memory.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--context", type=int, default=2048, help="speculative generation: prompt + answer tokens")
    p.add_argument("--real-compute", action="store_true", help="CPU: compute the matrix products too (slow)")
    p.add_argument("--skip-cycle", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--predict-only", action="store_true", help="only the table of predictions (what fits where)")
    p.add_argument("--sharded-load", action="store_true",
                   help="only the sharded loading measurement: 2 CPU processes, what each holds and its peak memory")
    p.add_argument("--measure", nargs=5, default=None, help=argparse.SUPPRESS)  # internal: one measurement
    a = p.parse_args(argv)
    if a.measure:
        return _measure(*a.measure)
    if a.predict_only:
        return fits_table()
    if a.sharded_load:
        return sharded_load()
    device = torch.device(a.device)
    skip = device.type == "cpu" and not a.real_compute
    how = "matmuls not computed" if skip else "real compute"
    config = LLAMA_3_2_1B
    print(f"training step, {config.name_or_path} target, offline, fp32, 1 x T tokens (half carry loss), 7 TTT "
          f"steps, 32k draft vocab, {device} ({how})")
    print(f"{'T':>6} {'predicted':>10} {'measured':>10} {'pred/meas':>9} {'above weights':>14} {'rss growth':>11}"
          f" {'step s':>7}")
    above = {}
    for t in a.seq_lens:
        est = memory.training_step(config, t, head_sharding="ddp", precision="fp32", target_dtype="fp32",
                                   offline=True)
        got = isolated("train", t, device, int(skip), a.threads or 0)
        above[t] = got["peak"] - got["fixed"]
        print(f"{t:>6} {est.total / GiB:>9.2f}G {got['peak'] / GiB:>9.2f}G {est.total / got['peak']:>9.3f} "
              f"{above[t] / GiB:>13.2f}G {got['rss']:>10.2f}G {got['seconds']:>7.1f}")
    if len(above) > 1:
        ts = sorted(above)
        print(f"step memory above the weights and optimizer state: x{above[ts[-1]] / above[ts[0]]:.2f} from T={ts[0]} "
              f"to T={ts[-1]} (x{ts[-1] / ts[0]:.2f} tokens): linear in T")
    print(memory.training_step(config, a.seq_lens[-1], precision="fp32", target_dtype="fp32", offline=True).format(
        f"predicted parts at T={a.seq_lens[-1]}:"))
    if not a.skip_cycle:
        est = memory.speculative_cycle(config, context=a.context, dtype="fp32",
                                       cpu_copies=("head",) if device.type == "cpu" else ())
        got = isolated("cycle", a.context, device, int(skip), a.threads or 0)
        print(f"\nspeculative generation, {config.name_or_path} target, fp32, one row of {a.context} tokens "
              f"({how}): predicted {est.total / GiB:.2f} GiB, measured {got['peak'] / GiB:.2f} GiB "
              f"(x{est.total / got['peak']:.3f}), rss growth {got['rss']:.2f} GiB, {got['seconds']:.1f} s")
    print("\npredictions (bf16 target and head autocast, 4096 tokens, batch 1, 7 TTT steps, 32k draft vocab):")
    print(memory.training_step(LLAMA_3_1_8B, 4096).format("Llama-3.1-8B on 1 x 80 GB (target replicated, DDP):"))
    print(memory.training_step(LLAMA_3_1_70B, 4096, placement="shard", processes=8, head_sharding="fsdp").format(
        "Llama-3.1-70B on 8 x 80 GB (target FSDP2 over the node, head FSDP):"))
    print(memory.speculative_cycle(LLAMA_3_1_8B, context=4096).format(
        "Llama-3.1-8B speculative generation, one row of 4096 tokens:"))


if __name__ == "__main__":
    main()
