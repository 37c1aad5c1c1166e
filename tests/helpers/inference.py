"""Helpers shared by the inference tests: reference decoding, random heads, test-only drafters and verifiers."""

import random

import torch
from transformers import DynamicCache

from eyas.inference.acceptance import verify
from eyas.inference.drafter import Candidates, DraftContext
from eyas.models import DraftHead, algorithm, head_config_for
from eyas.models.drafters.eagle1 import Eagle1Head
from eyas.models.kv_cache import KVCache

PROMPTS = [list(range(10, 22)), [40, 41, 7], list(range(100, 131, 2))]
NO_EOS = dict(eos_token_id=[])


def greedy(target, prompt, n):
    """The target's own greedy continuation, one plain forward per token."""
    ids = torch.tensor([prompt])
    cache = DynamicCache(config=target.model.config)
    out, nxt = [], ids
    for _ in range(n):
        logits = target.model(nxt, cache=cache, use_cache=True).logits[0, -1]
        out.append(int(logits.argmax()))
        nxt = torch.tensor([[out[-1]]])
    return out


def assert_drafts_verified(results, accepted=True):
    """Speculation ran over `results` (GenerationResults or their stats), so an identity check covered more than
    plain decoding: some cycle verified draft nodes and (`accepted`; a random head may accept nothing) some draft
    token was accepted: a cycle gained more than its bonus token."""
    stats = [getattr(r, "stats", r) for r in results]
    assert any(n > 0 for s in stats for n in s.drafted), "no cycle verified a draft: only plain decoding was tested"
    if accepted:
        assert any(a > 1 for s in stats for a in s.accepted), "no draft token was accepted"


def make_head(target, head_type="eagle3", seed=0, **config):
    """A random head of `head_type` (with an lm_head of its own: a 120-token draft vocabulary of random ids)."""
    torch.manual_seed(seed)
    reduced = algorithm(head_type).reduced_vocab
    head = DraftHead(head_config_for(target, head_type, draft_vocab_size=120 if reduced else None, **config), target)
    if reduced:
        head.set_vocab_map(torch.randperm(target.vocab_size)[:120])
    return head


def _next_rows(owner, batch):
    """The references of a generation of `batch` rows: all of them, or (a chain-verifying target decodes a batch
    one row at a time) the next `batch` in order."""
    start = 0 if batch == len(owner.all_refs) else owner.served
    owner.served = (start + batch) % len(owner.all_refs)
    return [owner.all_refs[(start + i) % len(owner.all_refs)] for i in range(batch)]


class Oracle:
    """Test-only drafter that proposes the target's own greedy continuation.

    `corrupt`: probability that one token of the chain is wrong (so acceptance stops there);
    `decoy`: put a wrong first child before the right one, so acceptance must take a second child.
    """

    def __init__(self, refs, depth, corrupt=0.0, decoy=False, seed=0):
        self.all_refs, self.served, self.refs = list(refs), 0, list(refs)
        self.depth, self.corrupt, self.decoy = depth, corrupt, decoy
        self.rng = random.Random(seed)

    def reset(self, batch, capacity):
        self.refs = _next_rows(self, batch)

    def keep_rows(self, order):
        self.refs = [self.refs[i] for i in order]

    def draft(self, ctx: DraftContext, depth=None, keep_going=None) -> Candidates:
        rows = []
        for b, n in enumerate(ctx.counts):
            p = int(ctx.positions[b, n - 1]) + 1  # the root's position
            ref = self.refs[b]
            assert int(ctx.tokens[b, n - 1]) == ref[p], "the root must be the last accepted token"
            chain = (ref[p + 1:] + [5] * self.depth)[:self.depth]  # past the reference's end: anything
            if self.rng.random() < self.corrupt:
                j = self.rng.randrange(self.depth)
                chain[j] = (chain[j] + 1) % 300
            tokens, parents = [], []
            if self.decoy:
                tokens.append((chain[0] + 7) % 300)
                parents.append(-1)
            for j, t in enumerate(chain):
                tokens.append(t)
                parents.append(-1 if j == 0 else len(tokens) - 2)
            rows.append((tokens, parents))
        tokens = torch.tensor([r[0] for r in rows])
        parents = torch.tensor([r[1] for r in rows])
        depth = torch.ones_like(parents)
        for i in range(parents.shape[1]):
            if (parents[:, i] >= 0).any():
                depth[:, i] = depth.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1
        root = torch.tensor([int(ctx.tokens[b, n - 1]) for b, n in enumerate(ctx.counts)])
        return Candidates(root, tokens, parents, torch.zeros(tokens.shape, dtype=torch.float), depth)


def always_accept_first_child(logits, tree, s, generator=None):
    """A deliberately biased verifier: the target "chooses" each node's first child whenever it has one."""
    b, n = tree.tokens.shape
    first = torch.full((b, n), n, dtype=torch.long)
    first.scatter_reduce_(1, tree.parents[:, 1:], torch.arange(1, n).expand(b, -1), "amin")
    has = first < n
    return torch.where(has, tree.tokens.gather(1, first.clamp(max=n - 1)), verify(logits, tree, s, generator))


class OracleHead(Eagle1Head):
    """Test-only EAGLE-1 head that knows each prompt's reference continuation (refs: prompt + continuation, in
    generate_batch order). Where the token it is given is the reference's at that position, its logits put the
    reference's next token first, so the real drafter (chain, static and dynamic expansions, the head's cache and
    masks) drafts long paths the target accepts. At a share `miss` of positions a wrong token is put first and the
    right one second: a chain stops there, a tree takes the second child."""

    BONUS = 30.0

    def __init__(self, target, refs, miss=0.2, seed=0):
        torch.manual_seed(seed)
        super().__init__(head_config_for(target, "eagle1"), target)
        self.all_refs, self.served, self.rows = list(refs), 0, list(refs)
        self.miss, self.seed = miss, seed

    def new_cache(self, batch, capacity):
        self.rows = _next_rows(self, batch)
        return _RowTrackingCache(self, self.config.num_layers, batch, capacity, self.fc.weight.device)

    def forward(self, input_ids, hidden, position_ids, allowed=None, cache=None, logits=True):
        out = super().forward(input_ids, hidden, position_ids, allowed, cache, logits)
        if out.logits is None:
            return out
        bonus = torch.zeros_like(out.logits)
        positions = position_ids.expand(input_ids.shape).tolist()
        every = [range(input_ids.shape[1])] * len(positions)
        projected = logits.tolist() if isinstance(logits, torch.Tensor) else every
        for b, (ids, pos) in enumerate(zip(input_ids.tolist(), positions)):
            ref = self.rows[b]
            for t, i in enumerate(projected[b]):  # x is the token at index q + 1; the output predicts q + 2
                x, q = ids[i], pos[i]
                if q + 2 < len(ref) and ref[q + 1] == x:
                    right = ref[q + 2]
                    if random.Random(hash((self.seed, q, right))).random() < self.miss:
                        bonus[b, t, (right + 1 + q) % bonus.shape[-1]] = self.BONUS
                        bonus[b, t, right] = self.BONUS / 2
                    else:
                        bonus[b, t, right] = self.BONUS
        out.logits = out.logits + bonus
        return out


class _RowTrackingCache(KVCache):
    """The oracle head's cache: when finished rows leave the batch, the head's references follow them."""

    def __init__(self, head, *args):
        super().__init__(*args)
        self.head = head

    def keep_rows(self, keep):
        order = super().keep_rows(keep)
        self.head.rows = [self.head.rows[i] for i in order]
        return order
