"""Speculative generation: prefill, then draft -> verify -> accept -> advance until every row is done.

Batches hold prompts of different lengths: left padding plus a `valid` mask over cache slots.
Rows accept different numbers of tokens per cycle; each keeps prefix + its own accepted path in
the target cache and, to keep one rectangular cache, pads shorter paths in front with slots it
marks invalid and never attends to again (so the newest token is always the last slot). The head cache mirrors the target cache slot for slot, so one
`valid` mask serves both. A row that is done (eos, stop string, length) leaves the batch before
the next cycle. Only the CLI prints; generation returns tokens and stats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence, Union

import numpy as np
import torch

from eyas.models import DraftHead, Target

from .acceptance import Sampling, Verifier, accept, target_tokens, verify
from .drafter import DraftContext, Drafter, DynamicExpansion, HeadDrafter, TreeOptions
from .lookup import MAX_NGRAM, accepted_prefix, graft, ngram_continuation
from .tree import DraftTree, on_continuation, tree_attention

if TYPE_CHECKING:
    from .tuning import Planner

Prompt = Union[Sequence[int], torch.Tensor, str, Sequence[dict]]


@dataclass
class GenerationStats:
    accepted: list[int] = field(default_factory=list)  # tokens gained per verify forward (accepted drafts + 1)
    draft_time_s: float = 0.0  # head forwards: catch-up on accepted tokens + drafting
    target_time_s: float = 0.0  # target forwards: prefill + verifies
    total_time_s: float = 0.0  # the whole call; total - draft - target = engine overhead
    prefill_time_s: float = 0.0  # part of target_time_s spent on the prompt
    drafted: list[int] = field(default_factory=list)  # draft nodes verified per cycle (0: plain decoding)
    depths: list[int] = field(default_factory=list)  # draft tree depth per cycle (0: plain decoding)

    @property
    def mean_accepted(self) -> float:
        """τ: mean tokens per target forward after the prefill."""
        return sum(self.accepted) / max(1, len(self.accepted))


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only, eos included if hit
    text: str
    stats: GenerationStats


class _Row:
    """One prompt's output so far, and when it must stop (eos, stop string, length)."""

    def __init__(self, tokenizer, max_new_tokens: int, eos: set[int], stop: Sequence[str]) -> None:
        self.tokenizer, self.max_new_tokens, self.eos, self.stop = tokenizer, max_new_tokens, eos, list(stop)
        self.tokens: list[int] = []
        self.done = max_new_tokens <= 0

    def add(self, new: list[int]) -> None:
        start = len(self.tokens)
        for t in new:
            self.tokens.append(t)
            if t in self.eos or len(self.tokens) >= self.max_new_tokens:
                self.done = True
                break
        if self.stop and any(s in self.text for s in self.stop):
            # keep the shortest output that contains a stop string (like transformers' stop_strings)
            for end in range(start + 1, len(self.tokens) + 1):
                if any(s in self.tokenizer.decode(self.tokens[:end], skip_special_tokens=True) for s in self.stop):
                    del self.tokens[end:]
                    break
            self.done = True

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)


class SpeculativeGenerator:
    def __init__(self, target: Target, head: DraftHead, options: TreeOptions | None = None,
                 drafter: Drafter | None = None, verifier: Verifier = verify) -> None:
        """`drafter` replaces the head drafter (tests use an oracle); `verifier` the acceptance rule (tests bias it)."""
        self.target, self.head = target, head
        self.options = options or TreeOptions()
        self.planner: Planner | None = None  # once "auto" is tuned: decides each cycle's tree
        self.drafter = drafter or HeadDrafter(head, self.options.expansion())
        self.verifier = verifier
        self.layer_ids = tuple(head.config.fused_layer_ids)

    @classmethod
    def from_pretrained(cls, target: str | Target, head: str | DraftHead, dtype: str = "fp32",
                        device: str | torch.device = "cpu", **tree_options) -> "SpeculativeGenerator":
        """target: a Target (used where it is) or a spec for Target.load; head: a DraftHead or a head folder.
        tree_options: the fields of TreeOptions (kind, depth, top_k, total_tokens, paths)."""
        from eyas.models import load_head

        if isinstance(target, str):
            target = Target.load(target, dtype=dtype, device=device)
        if isinstance(head, str):
            head = load_head(head, target)
        head.bind(target)
        head.to(device=target.device, dtype=target.dtype)
        return cls(target, head, TreeOptions(**tree_options))

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompt: Prompt, **kw) -> GenerationResult:
        return self.generate_batch([prompt], **kw)[0]

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 256, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, eos_token_id: int | Sequence[int] | None = None,
                       stop: Sequence[str] | None = None, seed: int | None = None) -> list[GenerationResult]:
        rows, stats = self._rows(len(prompts), max_new_tokens, eos_token_id, stop)
        for _ in self._decode([self.encode(p) for p in prompts], rows, stats, Sampling(temperature, top_p, top_k), seed):
            pass
        return [GenerationResult(r.tokens, r.text, s) for r, s in zip(rows, stats)]

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, eos_token_id: int | Sequence[int] | None = None, stop: Sequence[str] | None = None,
               seed: int | None = None, stats: GenerationStats | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are accepted. Pass `stats` to have them filled in."""
        rows, all_stats = self._rows(1, max_new_tokens, eos_token_id, stop, [stats] if stats is not None else None)
        shown = ""
        for _ in self._decode([self.encode(prompt)], rows, all_stats, Sampling(temperature, top_p, top_k), seed):
            text = rows[0].text
            # hold back an incomplete UTF-8 character; re-decoding the whole output keeps merges right
            if text.startswith(shown) and not text.endswith("\ufffd") and len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        text = rows[0].text
        if text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown):]

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids, text (tokenised as is) or chat messages (chat template + generation prompt)."""
        tok = self.target.tokenizer
        if isinstance(prompt, torch.Tensor):
            return prompt.flatten().tolist()
        if isinstance(prompt, str):
            ids = tok(prompt).input_ids
        elif prompt and isinstance(prompt[0], dict):
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return list(ids)

    # ---- the loop -----------------------------------------------------------------------------
    def _rows(self, n: int, max_new_tokens: int, eos_token_id, stop, stats=None):
        if eos_token_id is None:
            eos_token_id = self.target.model.generation_config.eos_token_id
            if eos_token_id is None and self.target.tokenizer is not None:
                eos_token_id = self.target.tokenizer.eos_token_id
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        rows = [_Row(self.target.tokenizer, max_new_tokens, eos, stop or ()) for _ in range(n)]
        return rows, stats or [GenerationStats() for _ in range(n)]

    def _features(self, out) -> torch.Tensor:
        return out.features if self.layer_ids else out.hidden

    @torch.no_grad()
    def _decode(self, prompts: list[list[int]], rows: list[_Row], stats: list[GenerationStats], s: Sampling,
                seed: int | None) -> Iterator[None]:
        """Run until every row is done, filling rows and stats; yields after each cycle (for streaming)."""
        target, dev = self.target, self.target.device
        clock = _Clock(dev)
        start = clock()
        gen = torch.Generator(dev).manual_seed(seed) if seed is not None else None
        b, t = len(prompts), max(len(p) for p in prompts)
        limit = getattr(target.config, "max_position_embeddings", None)
        longest = max(len(p) + r.max_new_tokens for p, r in zip(prompts, rows))
        if limit is not None and longest > limit:
            raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceeds the target's "
                             f"max_position_embeddings ({limit}); shorten the prompt or lower max_new_tokens")
        pad = target.tokenizer.pad_token_id if target.tokenizer is not None and target.tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (t - len(p)) + p for p in prompts], device=dev)
        valid = torch.tensor([[False] * (t - len(p)) + [True] * len(p) for p in prompts], device=dev)
        pos = (valid.cumsum(1) - 1).clamp(min=0)
        cache = target.new_cache()
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        mask = causal & (valid[:, None, :] | torch.eye(t, dtype=torch.bool, device=dev))

        t0 = clock()
        out = target(ids, pos, mask, cache, layer_ids=self.layer_ids, logits_to_keep=torch.full((b, 1), t - 1, device=dev))
        root = target_tokens(out.logits, s, gen)[:, 0]
        prefill = clock() - t0
        for st in stats:
            st.prefill_time_s = st.target_time_s = prefill
        ctx = DraftContext(tokens=torch.cat([ids[:, 1:], root[:, None]], 1), features=self._features(out),
                           positions=pos, valid=valid)
        next_pos = pos[:, -1] + 1
        self.drafter.reset()
        if (self.planner is None and self.options.total_tokens == "auto" and self.options.kind == "dynamic"
                and isinstance(self.drafter, HeadDrafter)):
            self._tune(cache, ctx, next_pos)
        for r, tok in zip(rows, root.tolist()):
            r.add([tok])
        yield

        live = list(range(b))  # batch row -> index into rows
        while keep := [i for i, j in enumerate(live) if not rows[j].done]:
            if len(keep) < len(live):  # finished rows leave the batch: no compute is spent on them any more
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                self.drafter.keep_rows(idx)
                ctx, next_pos = ctx.rows(idx), next_pos[idx]
                valid, live, b = ctx.valid, [live[i] for i in keep], len(keep)
            planner = self.planner
            t0 = clock()
            drafted = planner is None or planner.should_draft()
            if drafted:
                if planner is not None:
                    self.drafter.expansion = planner.expansion
                tree = self.drafter.draft(ctx)
            else:  # drafting does not pay at the moment: verify the root alone, the head skips this cycle
                tree = DraftTree.root_only(ctx.tokens[:, -1])
            head_nodes = tree.size
            chains, ngrams = self._lookup(head_nodes - 1, [prompts[j] + rows[j].tokens for j in live])
            if any(chains):
                tree = graft(tree, chains)
            t1 = clock()
            anc = tree.ancestors()
            past = valid.shape[1]
            # a chain over an unpadded cache is plain causal attention: without a mask the target's
            # attention takes its fastest path (plain cycles are most cycles when the head is weak)
            mask = None if tree.is_chain and bool(valid.all()) else tree_attention(valid, anc)
            out = target(tree.tokens, next_pos[:, None] + tree.depth, mask, cache, layer_ids=self.layer_ids)
            t2 = clock()
            acc = accept(tree, self.verifier(out.logits, tree, s, gen), anc)
            a = acc.path.shape[1]
            Target.keep_cache(cache, torch.cat([torch.arange(past, device=dev).expand(b, -1), past + acc.path], 1))
            path_tokens = tree.tokens.gather(1, acc.path)
            # EAGLE shift: the token after each path node is the next one, after the last the bonus
            after = torch.cat([path_tokens[:, 1:], acc.bonus[:, None]], 1)
            offset = torch.arange(a, device=dev) - (a - acc.length)[:, None]  # < 0 on front padding
            feats = self._features(out)
            new = DraftContext(tokens=after, features=feats.gather(1, acc.path[..., None].expand(-1, -1, feats.shape[-1])),
                               positions=next_pos[:, None] + offset.clamp(min=0), valid=torch.cat([valid, offset >= 0], 1))
            # a cycle without a draft left ctx unseen by the head: it catches up on both at its next draft
            ctx = new if drafted else ctx.then(new)
            valid = ctx.valid
            next_pos = next_pos + acc.length
            lengths, depth = acc.length.tolist(), int(tree.depth.max())
            if planner is not None:
                self._observe(planner, drafted, tree.size - 1, after, acc.length)
                if any(chains):
                    drafts = [toks[len(toks) - n + 1:] for toks, n in zip(path_tokens.tolist(), lengths)]
                    planner.observe_lookup([len(c) for c in chains],
                                           [accepted_prefix(c, d) for c, d in zip(chains, drafts)], ngrams)
            for j, toks, n in zip(live, after.tolist(), lengths):
                rows[j].add(toks[len(toks) - n:])
                stats[j].accepted.append(n)
                stats[j].drafted.append(tree.size - 1)
                stats[j].depths.append(depth)
                stats[j].draft_time_s += t1 - t0
                stats[j].target_time_s += t2 - t1
            yield
        total = clock() - start
        for st in stats:
            st.total_time_s = total

    def _observe(self, planner: Planner, drafted: bool, nodes: int, after: torch.Tensor, length: torch.Tensor) -> None:
        """Tell the planner what the cycle cost and gained, and which of the head's candidates (all it drafted,
        verified or not) spelled the tokens the target produced (after [B, A], right-aligned, length [B])."""
        if drafted:
            cand = self.drafter.candidates
            on, known = on_continuation(cand, after, length)
            conf = cand.scores[:, 1:].float().exp()[known[:, 1:]].cpu().numpy()
            hit = on[:, 1:][known[:, 1:]].cpu().numpy()
            steps = int(cand.depth.max())  # head forwards: the catch-up, then one per level below the first
        else:
            conf = hit = np.zeros(0)
            steps = 0
        planner.observe(conf, hit, float(length.float().mean()), planner.cost(nodes, steps))

    def _lookup(self, head_nodes: int, histories: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """Per row the n-gram branch to graft (maybe empty) onto a tree of head_nodes draft nodes, and the
        length of the match it came from."""
        # branch length per match length n (index n; no match, n = 0, gets none)
        sizes = [0] + [self.options.lookup if self.planner is None else
                       min(self.options.lookup, self.planner.lookup_tokens(head_nodes, n)) for n in range(1, MAX_NGRAM + 1)]
        if max(sizes) == 0:  # no branch pays from any match: skip the search, a Python scan over the history
            return [], []
        found = [ngram_continuation(h, max(sizes), MAX_NGRAM) for h in histories]
        return [c[: sizes[n]] for c, n in found], [n for _, n in found]

    def _tune(self, cache, ctx: DraftContext, next_pos: torch.Tensor) -> None:
        """Time target forwards per size and one large draft tree: the Planner's cost model."""
        from .tuning import Planner, fit_cost, measure_target_cost

        costs = measure_target_cost(self.target, cache, ctx.valid, next_pos)
        plain_s = costs.pop(1)
        depth = self.options.depth
        probe = HeadDrafter(self.head, DynamicExpansion(depth, self.options.top_k, total_tokens=1 << 30))
        probe.reset()
        probe.draft(ctx)  # its catch-up runs over the whole prompt, unlike a cycle's: not timed
        last = DraftContext(ctx.tokens[:, -1:], ctx.features[:, -1:], ctx.positions[:, -1:],
                            torch.cat([ctx.valid, ctx.valid[:, -1:]], 1))
        clock = _Clock(self.target.device)
        t0 = clock()
        probe.draft(last)  # a cycle's draft: one accepted token, then depth - 1 levels
        step_s = (clock() - t0) / depth
        self.planner = Planner(fit_cost(costs), step_s, plain_s, depth, top_k=self.options.top_k,
                               lookup_max=self.options.lookup)


class _Clock:
    """Wall time; waits for queued GPU work so each phase is charged to itself."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None

    def __call__(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()
