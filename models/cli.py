"""`eyas export`: turn a head folder or a training checkpoint into a head in a chosen layout."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a head (or training checkpoint) as eyas, SGLang, speculators/vLLM or EAGLE-1 layout",
        description="Export a trained draft head. HEAD_OR_CHECKPOINT is a head folder (any supported layout) or a "
        "training checkpoint folder. The output is written atomically: an interrupted export leaves no half-written folder.",
    )
    p.add_argument("source", metavar="HEAD_OR_CHECKPOINT", help="head folder or training checkpoint folder")
    p.add_argument("--out", required=True, help="output folder (replaced atomically if it exists)")
    p.add_argument("--format", default="eyas", choices=["eyas", "sglang", "speculators", "eagle"],
                   help="eyas: native (default); sglang: LlamaForCausalLMEagle3 layout (EAGLE-3 reference); "
                   "speculators: vLLM's speculators eagle3 layout; eagle: EAGLE-1 reference layout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .interop import export_head

    out = export_head(args.source, args.out, args.format)
    print(f"wrote {args.format} head to {out}")
    return 0
