"""Peak memory per process of one training step and of one speculative cycle, predicted from shapes alone.

The target is read from its transformers config (built on the meta device: exact parameter counts for any
architecture, no weights); the head is the one `head_config_for` derives from it. What is counted:

- training: the target weights this process holds (placement: a whole copy, an FSDP2 shard with the embedding
  and lm_head whole and one or two layers gathered at a time, or, offline, no decoder layers), the
  target's outputs the step keeps (fused-layer features, final hidden states) and its forward's largest layer
  temporaries (online); the head's fp32 master weights, gradients and AdamW state (divided over the processes by
  ZeRO/FSDP); the TTT unroll's activations kept for backward, counted tensor by tensor from models/layers.py and
  models/ttt.py at each step's rows (checkpointed attention keeps only its inputs); the logits of every step's
  loss rows and the teacher's draft-vocabulary distribution at those rows; and the larger of the two moments
  the step peaks at (end of forward, start of backward).
- a speculative cycle: target and head weights, both KV caches at the context length, and the largest of the
  prefill's and the verify forward's temporaries (a layer's activations, masks, the verified rows' logits).

Not counted: the CUDA context and allocator fragmentation (a few hundred MiB to a few GiB on a GPU), NCCL
buffers, Python. `python -m eyas.models.memory --help` prints estimates for a target config.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from .drafters import NAMES

GiB = 2**30
_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Estimate:
    """Bytes per process, by part; `total` is the peak."""

    parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def format(self, title: str = "") -> str:
        width = max(map(len, self.parts)) if self.parts else 10
        lines = [title] if title else []
        lines += [f"  {k:<{width}}  {v / GiB:8.2f} GiB" for k, v in self.parts.items()]
        lines.append(f"  {'total (peak)':<{width}}  {self.total / GiB:8.2f} GiB")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class TargetShape:
    """Parameter counts and sizes of a target, from its config."""

    embed: int  # input embedding elements
    lm_head: int  # output embedding elements (0 when tied to the input embedding)
    layers: list[int]  # elements per decoder layer
    other: int  # everything else (final norm, ...)
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def total(self) -> int:
        return self.embed + self.lm_head + sum(self.layers) + self.other


def meta_target(config):
    """The eyas Target of `config` on the meta device (no weights): shapes for the estimator and head config."""
    from transformers import AutoModelForCausalLM

    from .target import Target

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Target(model, None, getattr(config, "name_or_path", "") or type(model).__name__, cpu_kernels=False)


def target_shape(target) -> TargetShape:
    embed, lm_head = target.embed_tokens.weight, target.lm_head.weight
    layers = [sum(p.numel() for p in layer.parameters()) for layer in target._layers]
    tied = lm_head is embed
    total = sum(p.numel() for p in target.model.parameters())
    c = target.config
    heads = c.num_attention_heads
    return TargetShape(embed.numel(), 0 if tied else lm_head.numel(), layers,
                       total - embed.numel() - (0 if tied else lm_head.numel()) - sum(layers), target.hidden_size,
                       getattr(c, "intermediate_size", None) or 4 * target.hidden_size, heads,
                       getattr(c, "num_key_value_heads", None) or heads,
                       getattr(c, "head_dim", None) or target.hidden_size // heads, target.vocab_size)


def head_parameters(head_config) -> int:
    from .drafters.base import DraftHead

    with torch.device("meta"):
        head = DraftHead(head_config)
    return sum(p.numel() for p in head.parameters())


def ttt_rows(seq_len: int, loss_fraction: float, steps: int) -> tuple[int, list[int], list[int]]:
    """(step-0 indices, rows per packed step, loss rows per step) of one sequence whose last `loss_fraction` of
    tokens carry loss (an answer after its prompt), as losses.py's plan selects them: step i runs at the indices
    that lead to a loss at a step >= i, and index t carries loss at step i when token t+1+i does."""
    taught = max(1, min(seq_len - 1, round(loss_fraction * seq_len)))
    return seq_len - 1, [min(seq_len - 1, taught + steps - 1 - i) for i in range(steps)], [taught] * steps


def _saved_per_row(hc, fused: bool, chain: int) -> tuple[int, int]:
    """Elements one head decoder layer keeps for backward per row of a packed TTT step (models/layers.py,
    models/ttt.py), split into (norm-side: fp32 under bf16 autocast, matmul-side: the activation dtype).
    Norm side: the input norms' normalised copies (input and, fused, embedding: the embedding itself needs no
    gradient), the attention input, the post-attention norm's copy and output. Matmul side: the layer input and
    the residual after attention, the scaled query, its copy for the own-chain scores and the attention output,
    the MLP's gate, silu, up and product, and the chain's keys and values (`chain` per row)."""
    h, i = hc.hidden_size, hc.intermediate_size
    q, kv = hc.num_attention_heads * hc.head_dim, hc.num_key_value_heads * hc.head_dim
    norm = (2 * h + 2 * h if fused else h + h) + 2 * h
    matmul = 2 * h + 3 * q + 4 * i + 2 * kv * chain
    return norm, matmul


def ttt_activations(hc, n0: int, rows: list[int], loss_rows: list[int], fused: bool, itemsize: int,
                    batch: int) -> dict[str, float]:
    """Bytes one sequence's training-time-test unroll (models/ttt.py) keeps for the backward, counted tensor by
    tensor from models/layers.py and models/ttt.py: step 0 over n0 indices, step i over rows[i] packed rows,
    loss_rows[i] of them carrying loss; fused: the first layer fuses the embedding (EAGLE-3) or not (EAGLE-1);
    batch: sequences per micro-batch (a packed step over all of them is chunked, and checkpointed, past a memory
    budget). Checkpointed attention keeps only its inputs; RMSNorm computes in fp32 (x.float())."""
    from .ttt import rows_per_chunk

    h, q = hc.hidden_size, hc.num_attention_heads * hc.head_dim
    kv = hc.num_key_value_heads * hc.head_dim
    norm_side = matmul_side = scores = 0
    chunk = rows_per_chunk(hc.num_attention_heads, n0)
    for layer in range(hc.num_layers):
        first = fused and layer == 0
        # step 0 over every index: norms and attention input, the query after RoPE, keys and values repeated per
        # query head, the attention output and its o_proj copy, the residual; the last layer's MLP (and
        # post-attention norm) only at the rows that lead to a loss
        mlp_rows = rows[0] if layer == hc.num_layers - 1 else n0
        norm_side += n0 * ((2 * h if first else h) + (2 * h if first else h)) + mlp_rows * 2 * h
        matmul_side += n0 * (h + 5 * q + 2 * kv) + mlp_rows * (h + 4 * hc.intermediate_size)
        for step in range(1, len(rows)):
            n, m = _saved_per_row(hc, first, step)
            norm_side, matmul_side = norm_side + rows[step] * n, matmul_side + rows[step] * m
            if batch * rows[step] <= chunk:  # one chunk: not checkpointed, its probabilities and expanded K/V kept
                scores += rows[step] * hc.num_attention_heads * (n0 + step) + 2 * q * n0
    if fused:
        matmul_side += n0 * h  # the fc output (step 0's input)
    norm_side += sum(loss_rows) * 2 * h  # the final norm's copy and output at the loss rows
    matmul_side += sum(loss_rows) * h  # the picked rows
    parts = {"TTT activations": batch * (norm_side * 4 + matmul_side * itemsize)}
    if scores:
        parts["TTT attention (one chunk, kept)"] = batch * scores * 4
    return parts


def training_step(config, seq_len: int, batch: int = 1, head_type: str = "eagle3", draft_vocab_size: int = 32000,
                  head_layers: int | None = None, ttt_steps: int = 7, loss_fraction: float = 0.5,
                  precision: str = "bf16", target_dtype: str = "bf16", placement: str = "replicate",
                  processes: int = 1, group: int | None = None, head_sharding: str = "ddp",
                  offline: bool = False) -> Estimate:
    """Peak bytes of one optimizer step (a micro-batch of `batch` sequences of `seq_len` tokens) per process.

    head_type: any drafter algorithm (models/drafters), whose own model gives the unroll's activations;
    head_layers: its decoder layers (default: the algorithm's); placement: replicate | shard (the target, FSDP2);
    group: processes per sharding group (default all); head_sharding: ddp (whole head; several processes add
    gradient buckets) | zero2 (optimizer state and gradients divided) | zero3 / fsdp (weights too); precision: the
    head's (bf16 autocast or fp32); offline: the target's states come from a cache (no decoder layers, no target
    forward)."""
    from types import SimpleNamespace

    from .drafters import algorithm
    from .head_config import head_config_for

    target = meta_target(config)
    ts = target_shape(target)
    algo = algorithm(head_type)
    hc = head_config_for(target, head_type, draft_vocab_size=min(draft_vocab_size, target.vocab_size),
                         num_layers=head_layers)
    tb, ab = _ITEMSIZE[target_dtype], _ITEMSIZE[precision]
    group = group or processes
    e = Estimate()
    # ---- the frozen target
    whole = ts.embed + ts.lm_head
    if offline:
        held, gathered = whole + ts.other, 0
    elif placement == "replicate":
        held, gathered = ts.total, 0
    else:  # shard (FSDP2): layers (and the rest) divided over the group; embedding and lm_head whole once gathered
        held = whole + (sum(ts.layers) + ts.other) / group
        gathered = 2 * max(ts.layers)  # the layer running and the one prefetched
    e.parts["target weights"] = held * tb
    if gathered:
        e.parts["target layers gathered"] = gathered * tb
    n_read = len(algo.reads(hc, target.num_layers))
    # the states the head reads + final hidden, and the embedding rows of the batch's distinct ids (losses.py)
    kept = batch * seq_len * (1 + n_read) + min(batch * seq_len, ts.vocab)
    e.parts["target states (kept)"] = kept * ts.hidden * tb
    # ---- the head's persistent state: fp32 master weights, AdamW's two moments (gradients: see below)
    params = head_parameters(hc)
    shard = {"ddp": (1, 1, 1), "zero2": (1, processes, processes), "zero3": (processes,) * 3,
             "fsdp": (processes,) * 3}[head_sharding]
    e.parts["head weights (fp32)"] = 4 * params / shard[0]
    e.parts["head AdamW state"] = 8 * params / shard[2]
    if head_sharding == "ddp" and processes > 1:
        e.parts["head DDP gradient buckets"] = 4 * params
    if precision != "fp32":
        e.parts["head bf16 weight copies"] = ab * params / shard[0]
    if head_sharding in ("zero3", "fsdp"):
        e.parts["head weights gathered"] = ab * params
    # ---- the step: the algorithm's unroll, the logits of its loss rows, the teacher
    parts, loss_rows = algo.training_activations(hc, seq_len, loss_fraction, SimpleNamespace(ttt_steps=ttt_steps), ab,
                                                 batch)
    e.parts.update(parts)
    vocab = hc.draft_vocab_size
    logit_rows = batch * loss_rows
    e.parts["step logits (fp32)"] = logit_rows * vocab * 4
    # the step peaks at the end of the forward (the teacher's distribution at the taught rows, fp32, and the logits
    # it came from) or when the backward has the lm_head's gradients (weight and input) too
    taught = batch * min(loss_rows, max(1, round(loss_fraction * seq_len)))
    end_of_forward = taught * vocab * (4 + tb) + logit_rows * vocab * ab * (precision != "fp32")
    lm_head_grad = (vocab * hc.hidden_size * 4 if algo.reduced_vocab else 0) + logit_rows * hc.hidden_size * 4
    e.parts["teacher / lm_head gradients"] = max(end_of_forward, lm_head_grad)
    if not offline:  # the target's forward, before the head's step (its outputs are counted above)
        layer_tmp = ts.hidden * 4 + ts.heads * ts.head_dim + 2 * ts.kv_heads * ts.head_dim + 3 * ts.intermediate
        target_forward = batch * seq_len * (n_read * ts.hidden + layer_tmp) * tb
        step = sum(v for k, v in e.parts.items() if k.startswith(("TTT", "step", "teacher")))
        if target_forward > step:
            e.notes.append("the target's forward, not the head's step, sets the peak")
            for k in [k for k in e.parts if k.startswith(("TTT", "step", "teacher"))]:
                del e.parts[k]
            e.parts["target forward (transient)"] = target_forward
    # after the backward the activations are gone: the gradients and the optimizer's temporaries (same size)
    optimizer = 2 * 4 * params / shard[1]
    step = sum(v for k, v in e.parts.items() if k.startswith(("TTT", "step", "teacher", "target forward")))
    if optimizer > step:
        e.notes.append("the optimizer step, not the forward/backward, sets the peak")
        for k in [k for k in e.parts if k.startswith(("TTT", "step", "teacher", "target forward"))]:
            del e.parts[k]
        e.parts["head gradients + AdamW temporaries"] = optimizer
    e.notes.append(f"{params / 1e6:.0f}M {head_type} head parameters; {loss_rows} loss rows per sequence "
                   f"({loss_fraction:.0%} loss tokens)")
    return e


def speculative_cycle(config, batch: int = 1, context: int = 4096, prompt: int | None = None, tree_tokens: int = 64,
                      draft_vocab_size: int = 32000, dtype: str = "bf16", cpu_copies: tuple[str, ...] = (),
                      head_type: str = "eagle3", head_layers: int | None = None) -> Estimate:
    """Peak bytes of speculative generation for `batch` rows of `context` tokens (prompt + answer): weights, the
    target's and the head's KV caches, and the larger of the prefill's (a `prompt`-token forward, default the whole
    context, then the head's catch-up over it) and a verify forward's (tree_tokens per row) temporaries.
    cpu_copies: on a CPU in fp32, eyas's kernels keep a oneDNN copy of the linear weights of "head" (the drafter,
    always) and "target" (unless the Target was made with cpu_kernels=False)."""
    from .head_config import head_config_for

    target = meta_target(config)
    ts = target_shape(target)
    hc = head_config_for(target, head_type, draft_vocab_size=min(draft_vocab_size, target.vocab_size),
                         num_layers=head_layers)
    b = _ITEMSIZE[dtype]
    e = Estimate()
    e.parts["target weights"] = ts.total * b
    head_params = head_parameters(hc)
    e.parts["head weights"] = head_params * b
    if "target" in cpu_copies:
        e.parts["target weight copies (CPU kernels)"] = (sum(ts.layers) + ts.embed + ts.lm_head) * b
    if "head" in cpu_copies:  # every linear prepacked, and the lm_head as [in, out] for one-row products
        e.parts["head weight copies (CPU kernels)"] = (head_params + hc.draft_vocab_size * hc.hidden_size) * b
    kv = ts.kv_heads * ts.head_dim
    e.parts["target KV cache"] = len(ts.layers) * 2 * batch * context * kv * b
    e.parts["head KV cache"] = hc.num_layers * 2 * batch * context * hc.num_key_value_heads * hc.head_dim * b

    def forward(tokens: int, width: int, logit_rows: int) -> float:
        layer = ts.hidden * 4 + ts.heads * ts.head_dim + 2 * kv + 3 * ts.intermediate
        mask = batch * tokens * width * b  # the additive mask of what each new token sees
        return batch * tokens * layer * b + mask + batch * logit_rows * ts.vocab * (b + 4)  # logits and fp32 copy

    n = prompt or context
    features = batch * n * len(hc.fused_layer_ids) * ts.hidden * b * 2  # captured layer inputs and their concat
    q, hkv = hc.num_attention_heads * hc.head_dim, hc.num_key_value_heads * hc.head_dim
    catch_up = batch * n * (6 * hc.hidden_size + q + 2 * hkv + 3 * hc.intermediate_size) * b  # the head over it
    prefill = max(forward(n, n, 1) + features, features + catch_up)
    verify = forward(tree_tokens, context, tree_tokens)
    e.parts["forward (transient)"] = max(prefill, verify)
    e.notes.append(f"prefill {prefill / GiB:.2f} GiB, verify of {tree_tokens} tokens {verify / GiB:.2f} GiB")
    return e


# ---- what fits where ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eyas.models.memory", description="Predicted peak memory per "
                                "process of an eyas training step and of speculative generation, for a target "
                                "config (a folder, hub id or config.json; no weights are loaded).")
    p.add_argument("--target", required=True, help="target folder, hub id or config.json")
    p.add_argument("--head-type", default="eagle3", choices=NAMES, help="the drafter algorithm (default eagle3)")
    p.add_argument("--head-layers", type=int, default=None, help="its decoder layers (default: the algorithm's)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="sequences per process per micro-batch")
    p.add_argument("--processes", type=int, default=1, help="GPUs (processes) of the run")
    p.add_argument("--group", type=int, default=None, help="processes per sharding group (default: --processes)")
    p.add_argument("--placement", choices=["replicate", "shard"], default="replicate",
                   help="the target: a whole copy per GPU, or sharded over --group GPUs (FSDP2)")
    p.add_argument("--head-sharding", choices=["ddp", "zero2", "zero3", "fsdp"], default="ddp")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--offline", action="store_true", help="states from a hidden-state cache")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory per GPU, to say whether it fits")
    a = p.parse_args(argv)
    config = load_config(a.target)
    train = training_step(config, a.seq_len, a.batch, head_type=a.head_type, head_layers=a.head_layers,
                          draft_vocab_size=a.draft_vocab, ttt_steps=a.ttt_steps,
                          precision=a.precision, target_dtype="bf16" if a.precision == "bf16" else "fp32",
                          placement=a.placement, processes=a.processes, group=a.group, head_sharding=a.head_sharding,
                          offline=a.offline)
    cycle = speculative_cycle(config, context=a.seq_len, draft_vocab_size=a.draft_vocab, head_type=a.head_type,
                              head_layers=a.head_layers)
    for name, est in (("training step", train), ("speculative generation", cycle)):
        fits = "fits" if est.total <= a.gpu_gib * GiB else "does NOT fit"
        print(est.format(f"{name} ({fits} in {a.gpu_gib:g} GiB):"))
    return 0


def load_config(spec: str):
    """A transformers config from a folder, a hub id or a config.json file."""
    from pathlib import Path

    from transformers import AutoConfig

    path = Path(spec)
    if path.is_file():
        import json

        raw = json.loads(path.read_text())
        return AutoConfig.for_model(raw.pop("model_type"), **raw)
    return AutoConfig.from_pretrained(spec)


if __name__ == "__main__":
    raise SystemExit(main())
