"""Time compiled forwards that compute their logits in their graph (as eyas runs them, where a model's logits are its
lm_head's output alone) against the same forwards with the logits computed after the graph, by the lm_head's own
call (`Target._head_in_graph` held to False).

    python benchmarks/logits_in_graph_ab.py --dtype bf16 --tokens 1 --rounds 600

Two compiled Targets over one model in one process (the held-back one runs graphs of its own: the decoder without the
lm_head). A round runs one forward of --tokens tokens of each over --context cached tokens (one token: a plain step,
the logits of its token; more: a verify of a chain under a tree mask, the logits of every token), the order switching
every round, so the machine's drift hits both alike. Printed: each one's median forward and the median per-round
ratio of the held-back forward to eyas's (above 1: computing the logits in the graph helps).
"""
from __future__ import annotations

from step_ab import alternate, forwards, parser, report  # beside this script

from eyas.models import Target


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)

    eager = Target.load(args.target, dtype=args.dtype, device="cpu")
    eyas = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    after = Target(eager.model, eager.tokenizer, eager.name_or_path, compile=True)
    after._head_in_graph = lambda: False
    held = "logits after the graph"
    took = alternate(forwards({"eyas": eyas, held: after}, args.context, args.tokens), args.rounds, switch=True)
    report(took, f"{args.dtype} {args.tokens} tokens", held, args.rounds)


if __name__ == "__main__":
    main()
