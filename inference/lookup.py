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


class NgramIndex:
    """Where each n-gram (n <= max_ngram) of a growing token sequence last occurred with a token after it.

    Prompt-lookup's question, "which tokens followed the latest earlier occurrence of the last n tokens",
    answered in O(max_ngram) per cycle: the index is updated as tokens are appended, never rescanned
    (a scan over a long document each cycle costs a fair part of a plain forward on a CPU).
    """

    def __init__(self, ids: Sequence[int] = (), max_ngram: int = MAX_NGRAM) -> None:
        self.ids: list[int] = []
        self.max_ngram = max_ngram
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram)]  # [n-1]: gram -> next index
        self.extend(ids)

    def extend(self, tokens: Sequence[int]) -> None:
        ids = self.ids
        for t in tokens:
            end = len(ids)  # the grams ending just before t now have a follower: t, at index `end`
            for n in range(1, min(self.max_ngram, end) + 1):
                self._after[n - 1][tuple(ids[end - n:end])] = end
            ids.append(t)

    def continuation(self, num_tokens: int) -> tuple[list[int], int]:
        """(tokens, n): up to num_tokens tokens that followed the latest earlier occurrence of the last n tokens,
        trying n = max_ngram down to 1; ([], 0) when nothing matches. n says how much to trust them: a
        three-token match is copied text far more often than a one-token one."""
        ids, end = self.ids, len(self.ids)
        if num_tokens <= 0:
            return [], 0
        for n in range(min(self.max_ngram, end - 1), 0, -1):
            start = self._after[n - 1].get(tuple(ids[end - n:]))
            if start is not None:
                return ids[start:start + num_tokens], n
        return [], 0


def graft(tree: DraftTree, chains: Sequence[Sequence[int]]) -> DraftTree:
    """Hang chains[b] from row b's root, reusing the nodes whose tokens agree; rows keep one size.

    New nodes get score 0 (they are not the head's). A row that adds fewer nodes than the longest is
    padded with a chain under its last node (always a leaf: children come after their parents),
    repeating that node's token: verified like any draft, so harmless if rejected and right if accepted.
    """
    rows = []
    all_tokens, all_parents, all_depth = torch.stack([tree.tokens, tree.parents, tree.depth]).tolist()  # one read
    for chain, tokens, parents, depth in zip(chains, all_tokens, all_parents, all_depth):
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
                     depth=torch.tensor([r[2] for r in rows], device=dev), scores=scores,
                     height=max(max(r[2]) for r in rows), chain=all(r[1] == list(range(-1, n - 1)) for r in rows))


def accepted_prefix(chain: Sequence[int], accepted: Sequence[int]) -> int:
    """How many leading tokens of a proposed chain the target accepted."""
    k = 0
    for c, a in zip(chain, accepted):
        if c != a:
            break
        k += 1
    return k
