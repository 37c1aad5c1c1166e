"""N-gram branches: text the model is about to copy (from the prompt or its own output) drafted for free.

Prompt-lookup decoding proposes, after the last n tokens, the tokens that followed the most recent
earlier occurrence of those n tokens. It costs no model call, and on extraction, editing and code it
is accepted for long runs where a one-layer head guesses poorly; on free prose it rarely matches.
eyas grafts that continuation onto the head's tree as one more branch from the root (sharing the
nodes where the head proposed the same tokens), so a cycle gets whichever is right. The target
verifies it like any other node: greedy stays token-identical, and since the branch is chosen
without looking at the verification randomness, sampling stays exact too (acceptance.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .tree import DraftTree

MAX_NGRAM = 3  # longest match tried


def ngram_continuation(ids: Sequence[int], num_tokens: int, max_ngram: int = MAX_NGRAM) -> tuple[list[int], int]:
    """(tokens, n): up to num_tokens tokens that followed the latest earlier occurrence of ids' last n
    tokens, trying n = max_ngram down to 1; ([], 0) when nothing matches. n says how much to trust
    them: a three-token match is copied text far more often than a one-token one."""
    if num_tokens <= 0:
        return [], 0
    ids = list(ids)
    end = len(ids)
    for n in range(min(max_ngram, end - 1), 0, -1):
        tail = ids[end - n:]
        for start in range(end - n - 1, -1, -1):  # latest first: recent text predicts best
            if ids[start: start + n] == tail:
                return ids[start + n: start + n + num_tokens], n
    return [], 0


def graft(tree: DraftTree, chains: Sequence[Sequence[int]]) -> DraftTree:
    """Hang chains[b] from row b's root, reusing the nodes whose tokens agree; rows keep one size.

    New nodes get score 0 (they are not the head's). A row that adds fewer nodes than the longest is
    padded with a chain under its last node (always a leaf: children come after their parents),
    repeating that node's token: verified like any draft, so harmless if rejected and right if accepted.
    """
    rows = []
    for b, chain in enumerate(chains):
        tokens, parents, depth = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.depth[b].tolist()
        children: dict[int, dict[int, int]] = {}
        for i in range(1, len(tokens)):
            children.setdefault(parents[i], {})[tokens[i]] = i
        node = 0
        for t in chain:
            nxt = children.get(node, {}).get(t)
            if nxt is None:
                tokens.append(t)
                parents.append(node)
                depth.append(depth[node] + 1)
                nxt = len(tokens) - 1
                children.setdefault(node, {})[t] = nxt
            node = nxt
        rows.append((tokens, parents, depth))
    n = max(len(r[0]) for r in rows)
    for tokens, parents, depth in rows:
        while len(tokens) < n:
            parents.append(len(tokens) - 1)
            depth.append(depth[-1] + 1)
            tokens.append(tokens[-1])
    dev = tree.tokens.device
    scores = torch.zeros(len(rows), n, device=dev)
    scores[:, : tree.size] = tree.scores
    return DraftTree(tokens=torch.tensor([r[0] for r in rows], device=dev),
                     parents=torch.tensor([r[1] for r in rows], device=dev),
                     depth=torch.tensor([r[2] for r in rows], device=dev), scores=scores)


def accepted_prefix(chain: Sequence[int], accepted: Sequence[int]) -> int:
    """How many leading tokens of a proposed chain the target accepted."""
    k = 0
    for c, a in zip(chain, accepted):
        if c != a:
            break
        k += 1
    return k
