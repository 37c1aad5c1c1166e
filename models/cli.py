"""`eyas export`: turn a head folder or a training checkpoint into a head in a chosen layout."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a head (or training checkpoint) as eyas, SGLang, speculators/vLLM, z-lab DFlash or EAGLE-1 layout",
        description="Export a trained draft head. HEAD_OR_CHECKPOINT is a head folder (any supported layout) or a "
        "training checkpoint folder. The output is written atomically: an interrupted export leaves no half-written "
        "folder. "
        "Weights keep their dtype. SGLang and speculators hold EAGLE-3 heads (SGLang: one decoder layer), "
        "converted so the runtime computes what the head computes (fused layers sorted and padded to the three "
        "the runtimes read) or refused with the reason; speculators also holds P-EAGLE and DFlash heads, zlab "
        "DFlash heads (z-lab's dflash package and vLLM read it); eagle holds EAGLE-1 heads for eagle-llm 1.2.1. "
        "Foreign layouts carry no tokenizer fingerprint, so a head exported to one and imported back is checked "
        "against its target by hidden size, vocab size and layer count only. docs/runtimes.md has the details.",
        epilog="example: eyas export runs/smollm2/checkpoints/step-00002000 --out heads/smollm2-sglang --format sglang",
    )
    p.add_argument("source", metavar="HEAD_OR_CHECKPOINT", help="head folder or training checkpoint folder")
    p.add_argument("--out", required=True, help="output folder; an existing one is replaced (atomically) only if it "
                   "holds a head and nothing else")
    p.add_argument("--force", action="store_true", help="replace --out even if it holds other files")
    p.add_argument("--format", default="eyas", choices=["eyas", "sglang", "speculators", "zlab", "eagle"],
                   help="eyas: native (default); sglang: LlamaForCausalLMEagle3 layout (EAGLE-3 reference); "
                   "speculators: vLLM's speculators layout (eagle3, peagle, dflash); zlab: z-lab's DFlashDraftModel "
                   "layout; eagle: EAGLE-1 reference layout")
    p.add_argument("--target", default=None, metavar="SPEC",
                   help="target model (folder, .gguf, hub id or smollm2-135m) to check the head against; the eagle "
                   "format needs it (its file holds the target's embedding), speculators records its architecture, "
                   "zlab its layer count, and a foreign EAGLE-3 head that does not record its fused layers gets the "
                   "defaults 2, N//2, N-3")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .layouts import export_head
    from .target import Target

    target = Target.load(args.target) if args.target else None
    out = export_head(args.source, args.out, args.format, target, force=args.force)
    print(f"wrote {args.format} head to {out}")
    return 0
