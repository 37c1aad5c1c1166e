"""Speculative generation: prefill, then draft -> verify -> accept -> advance until every row is done.

Rows of a batch hold prompts of different lengths side by side in one KV cache (models/kv_cache.py),
each in its own columns from 0, and accept different numbers of tokens per cycle; the head's cache mirrors
the target's column for column. The prefill runs each whole prompt and decides the first generated token from
its logits, as plain decoding does (no extra forward per generation); that token is the first cycle's root.
A row that is done (eos, stop string, length) leaves the batch before the next cycle. Only the CLI prints;
generation returns tokens and stats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence, Union

import numpy as np
import torch

from eyas.data.chat_template import encode_prompt
from eyas.models import DraftHead, Target
from eyas.models.masks import after_history

from .acceptance import Verifier, accept, penalized, verify
from .costs import CostModel, calibrate
from .drafter import Candidates, DraftContext, Drafter, DynamicExpansion, HeadDrafter, TreeOptions
from .lookup import MAX_NGRAM, NgramIndex, accepted_prefix, graft
from .planner import Planner
from .sampling import Sampling
from .timing import Stopwatch
from .tree import DraftTree, on_continuation

Prompt = Union[Sequence[int], torch.Tensor, str, Sequence[dict]]


@dataclass
class GenerationStats:
    accepted: list[int] = field(default_factory=list)  # tokens gained per verify forward (accepted drafts + 1)
    prefill_tokens: int = 0  # tokens decided by the prefill's forward (the first generated one), not in `accepted`
    draft_time_s: float = 0.0  # head forwards: catch-up on accepted tokens + drafting
    target_time_s: float = 0.0  # target forwards: prefill + verifies
    total_time_s: float = 0.0  # the whole call; total - draft - target = engine overhead
    prefill_time_s: float = 0.0  # part of target_time_s spent on the prompt
    drafted: list[int] = field(default_factory=list)  # draft nodes verified per cycle (0: plain decoding)
    depths: list[int] = field(default_factory=list)  # draft tree depth per cycle (0: plain decoding)

    @property
    def mean_accepted(self) -> float:
        """τ: mean tokens per target verify forward."""
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
                 drafter: Drafter | None = None, verifier: Verifier = verify, costs: CostModel | None = None) -> None:
        """`drafter` replaces the head drafter (tests use an oracle); `verifier` the acceptance rule (tests bias it);
        `costs` what a cycle costs here (default: measured by `calibrate` when the planner first needs it)."""
        self.target, self.head = target, head
        self.options = options or TreeOptions()
        self.verifier = verifier
        self.layer_ids = tuple(head.config.fused_layer_ids)
        self._custom_drafter = drafter
        self.drafter = drafter
        self.planner: Planner | None = None  # decides each cycle's tree when options.planned
        if costs is not None:
            self.use_costs(costs)

    @classmethod
    def from_pretrained(cls, target: str | Target, head: str | DraftHead, dtype: str = "fp32",
                        device: str | torch.device = "cpu", **tree_options) -> "SpeculativeGenerator":
        """target: a Target (used where it is) or a spec for Target.load; head: a DraftHead or a head folder.
        tree_options: the fields of TreeOptions (kind, depth, top_k, total_tokens, paths, lookup)."""
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

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 256, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                       repetition_penalty: float | None = None, eos_token_id: int | Sequence[int] | None = None,
                       stop: Sequence[str] | None = None, seed: int | None = None) -> list[GenerationResult]:
        """Sampling settings left as None follow the target's generation_config, as `model.generate` does."""
        s = self.sampling(temperature, top_p, top_k, min_p, repetition_penalty)
        rows, stats = self._rows(len(prompts), max_new_tokens, eos_token_id, stop)
        for _ in self._decode([self.encode(p) for p in prompts], rows, stats, s, seed):
            pass
        return [GenerationResult(r.tokens, r.text, st) for r, st in zip(rows, stats)]

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               repetition_penalty: float | None = None, eos_token_id: int | Sequence[int] | None = None,
               stop: Sequence[str] | None = None, seed: int | None = None,
               stats: GenerationStats | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are accepted. Pass `stats` to have them filled in."""
        s = self.sampling(temperature, top_p, top_k, min_p, repetition_penalty)
        rows, all_stats = self._rows(1, max_new_tokens, eos_token_id, stop, [stats] if stats is not None else None)
        shown = ""
        for _ in self._decode([self.encode(prompt)], rows, all_stats, s, seed):
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
        return encode_prompt(self.target.tokenizer, prompt)

    def sampling(self, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 min_p: float | None = None, repetition_penalty: float | None = None) -> Sampling:
        """The settings a call with these arguments decodes with (unset ones from the target's generation_config)."""
        return Sampling.for_target(getattr(self.target.model, "generation_config", None), temperature, top_p, top_k,
                                   min_p, repetition_penalty)

    def calibrate(self, prompt: Prompt) -> CostModel:
        """Measure what a cycle costs on this machine (on scratch caches filled with `prompt`) and plan with it."""
        costs = calibrate(self.target, HeadDrafter(self.head, DynamicExpansion(self.options.depth, self.options.top_k)),
                          self.encode(prompt), self.options.depth)
        self.use_costs(costs)
        return costs

    def use_costs(self, costs: CostModel) -> None:
        """Plan each cycle with this cost model from now on (a fresh planner)."""
        self.planner = Planner(costs, self.options.depth, top_k=self.options.top_k, lookup_max=self.options.lookup)

    # ---- the loop -----------------------------------------------------------------------------
    def _rows(self, n: int, max_new_tokens: int, eos_token_id, stop, stats=None):
        eos = self.target.eos_ids() if eos_token_id is None else eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos)
        rows = [_Row(self.target.tokenizer, max_new_tokens, eos, stop or ()) for _ in range(n)]
        return rows, stats or [GenerationStats() for _ in range(n)]

    def _features(self, out) -> torch.Tensor:
        return out.features if self.layer_ids else out.hidden

    def _drafter(self, chains_only: bool) -> Drafter:
        if self._custom_drafter is not None:
            return self._custom_drafter
        o = self.options
        if chains_only:  # a target that verifies chains only: the same expansion with one child per node
            chain = TreeOptions("chain", o.depth).expansion()
            expansion = DynamicExpansion(o.depth, 1) if o.kind == "dynamic" else chain
        else:
            expansion = o.expansion()
        if not isinstance(self.drafter, HeadDrafter) or self.drafter.expansion.__dict__ != expansion.__dict__:
            self.drafter = HeadDrafter(self.head, expansion)
        return self.drafter

    @torch.no_grad()
    def _decode(self, prompts: list[list[int]], rows: list[_Row], stats: list[GenerationStats], s: Sampling,
                seed: int | None) -> Iterator[None]:
        """Run until every row is done, filling rows and stats; yields after each cycle (for streaming)."""
        target = self.target
        chains_only = target.verify_mode() == "chain"
        if chains_only and len(prompts) > 1:  # the model's own masks serve one row at a time
            for p, r, st in zip(prompts, rows, stats):
                yield from self._decode([p], [r], [st], s, seed)
            return
        dev = target.device
        watch = Stopwatch(dev)
        start = watch.mark()
        gen = torch.Generator(dev).manual_seed(seed) if seed is not None else None
        longest = max(len(p) + r.max_new_tokens for p, r in zip(prompts, rows))
        target.check_length(longest)
        drafter = self._drafter(chains_only)
        lookup = 0 if chains_only else self.options.lookup  # a branch beside a chain would make a tree
        planner = None
        if self.options.planned and isinstance(drafter, HeadDrafter):
            if self.planner is None:
                self.calibrate(prompts[0])
            planner = self.planner
        capacity = longest + self.options.max_nodes() + 2
        cache = target.new_cache(len(prompts), capacity)
        drafter.reset(len(prompts), capacity)

        seen = None
        if s.repetition_penalty != 1.0:
            seen = torch.zeros(len(prompts), target.vocab_size, dtype=torch.bool, device=dev)
            for b, p in enumerate(prompts):
                seen[b, torch.tensor(p, device=dev)] = True
        # prefill: every prompt whole; the target's choice after its last token is the first generated token
        ctx, root, prefill_s = self._prefill(prompts, cache, watch, seen, s, gen)
        first = root.tolist()
        for r, st, tok in zip(rows, stats, first):
            st.prefill_time_s = st.target_time_s = prefill_s
            if not r.done:
                r.add([tok])
                st.prefill_tokens = 1
        if seen is not None:
            seen[torch.arange(len(prompts), device=dev), root] = True
        if planner is not None:
            planner.begin(prefill_s)
        unseen = [ctx]  # what the head has not seen yet, oldest first: it catches up on all of it when it drafts
        behind = list(ctx.counts)  # per row: how many tokens that is
        # each row's n-grams, for lookup branches
        index = [NgramIndex(p + [tok]) for p, tok in zip(prompts, first)] if lookup else []
        yield  # the first token, as soon as the prompt is read (a stream shows it before any cycle)

        live = list(range(len(prompts)))  # batch row -> index into rows
        while keep := [i for i, j in enumerate(live) if not rows[j].done]:
            if len(keep) < len(live):  # finished rows leave the batch: no compute is spent on them any more
                order = cache.keep_rows(keep)  # kept rows move into the holes: `order` is the old row of each
                drafter.keep_rows(order)
                idx = torch.tensor(order, device=dev)
                unseen, root, live = [c.rows(order) for c in unseen], root[idx], [live[i] for i in order]
                behind = [behind[i] for i in order]
                index = [index[i] for i in order] if index else []
                seen = seen[idx] if seen is not None else None
            t0 = watch.mark()
            cycle_start = time.perf_counter()

            # 1. draft: the head's candidates, the planner's choice of them, and an n-gram branch
            catchup = max(behind)
            drafted = catchup > 0 and (planner is None or planner.should_draft(cache.width, catchup))
            candidates, levels = None, 0
            if drafted:
                ctx, unseen, behind = DraftContext.join(unseen), [], [0] * len(behind)
                candidates = drafter.draft(ctx, keep_going=planner.keep_drafting if planner is not None else None)
                t_draft = watch.mark()
                levels = candidates.height or 0
                tree = candidates.chain() if chains_only else self._select(candidates, levels, planner)
            else:  # drafting does not pay at the moment: verify the root alone, the head skips this cycle
                tree = DraftTree.root_only(root)
            chains, ngrams = self._lookup(tree.size - 1, index, planner, lookup)
            if any(chains):
                tree = graft(tree, chains)
            t1 = watch.mark()

            # 2. verify: one target forward over the whole tree
            anc = tree.ancestors()
            positions = cache.lengths[:, None] + tree.depth
            allowed = None if cache.uniform is not None and tree.chain else after_history(
                cache.lengths, anc, cache.width + tree.size)
            out = target(tree.tokens, positions, cache, allowed, layer_ids=self.layer_ids)

            # 3. accept: the longest path the target agrees with, plus its own next token
            acc = accept(tree, self._choices(out.logits, tree, anc, seen, s, gen), anc)
            path_tokens = tree.tokens.gather(1, acc.path)
            col = torch.arange(acc.path.shape[1], device=dev)
            last = col[None, :] == (acc.length - 1)[:, None]
            # EAGLE shift: the token after each path node is the next one, after the last the bonus
            after = torch.where(last, acc.bonus[:, None], torch.cat([path_tokens[:, 1:], acc.bonus[:, None]], 1))
            # the cycle's one read of the device: per row the tokens gained, the tree's depth, the tokens
            host = torch.cat([acc.length[:, None], tree.depth.max(1).values[:, None], after], 1).tolist()
            t2 = watch.mark()
            lengths = [h[0] for h in host]

            # 4. advance: keep the accepted path in the cache, hand its features to the head, record the tokens
            width = max(lengths)  # the path as wide as the longest row's (the head need not see the padding)
            path, after = acc.path[:, :width], after[:, :width]
            cache.commit(lengths, path)
            feats = self._features(out)
            unseen.append(DraftContext(tokens=after, positions=positions.gather(1, path), counts=lengths,
                                       features=feats.gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))))
            behind = [n + k for n, k in zip(behind, lengths)]
            root = acc.bonus
            if seen is not None:
                seen.scatter_(1, torch.where(col[None, :width] < acc.length[:, None], after, after[:, :1]), True)
            gained = [h[2:2 + n] for h, n in zip(host, lengths)]
            for ix, toks in zip(index, gained):
                ix.extend(toks)
            draft_s, verify_s = watch.between(t0, t1), watch.between(t1, t2)
            for j, toks, h in zip(live, gained, host):
                rows[j].add(toks)
                stats[j].accepted.append(len(toks))
                stats[j].drafted.append(tree.size - 1)
                stats[j].depths.append(h[1])
                stats[j].draft_time_s += draft_s
                stats[j].target_time_s += verify_s
            if planner is not None:
                if candidates is not None:
                    self._observe(planner, candidates, after, acc.length)
                if any(chains):
                    planner.observe_lookup([len(c) for c in chains],
                                           [accepted_prefix(c, g[:-1]) for c, g in zip(chains, gained)], ngrams)
                head_s = watch.between(t0, t_draft) if drafted else 0.0
                planner.observe_cycle(tree.size - 1, levels, sum(lengths) / len(lengths), head_s,
                                      time.perf_counter() - cycle_start - head_s)
            yield
        total = watch.between(start, watch.mark())
        for st in stats:
            st.total_time_s = total

    def _prefill(self, prompts: list[list[int]], cache, watch: Stopwatch, seen: torch.Tensor | None, s: Sampling,
                 gen: torch.Generator | None) -> tuple[DraftContext, torch.Tensor, float]:
        """Run every prompt into the cache (right-padded: causal attention never reaches the padding) and choose
        the first generated token from the logits after its last token, by the rule a cycle's root-only verify
        uses. Returns (the head's first context: the prompts' features, EAGLE-shifted, so that the first token
        pairs with the last prompt position; the first tokens [B]; seconds)."""
        dev = self.target.device
        counts = [len(p) for p in prompts]
        width = max(counts)
        ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts], device=dev)  # [B, W]
        end = torch.tensor(counts, device=dev)[:, None] - 1  # [B, 1] each prompt's last column
        t0 = watch.mark()
        out = self.target(ids, cache=cache, layer_ids=self.layer_ids, logits=end)
        last = DraftTree.root_only(ids.gather(1, end)[:, 0])
        first = self._choices(out.logits, last, last.ancestors(), seen, s, gen)[:, 0]  # [B]
        cache.commit(counts)
        tokens = torch.cat([ids[:, 1:], ids[:, -1:]], 1).scatter_(1, end, first[:, None])
        positions = torch.arange(width, device=dev).expand(len(prompts), -1)
        ctx = DraftContext(tokens, self._features(out), positions, counts)
        return ctx, first, watch.between(t0, watch.mark())

    def _choices(self, logits: torch.Tensor, tree: DraftTree, ancestors: torch.Tensor, seen: torch.Tensor | None,
                 s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
        """The target's choice y [B, N] at every node of a verified tree (logits [B, N, V]): the repetition
        penalty over what each node follows, then the verifier's rule."""
        if seen is not None:
            logits = penalized(logits, tree, ancestors, seen, s.repetition_penalty)
        return self.verifier(logits, tree, s, gen)

    def _select(self, candidates: Candidates, levels: int, planner: Planner | None) -> DraftTree:
        """Which candidates the target verifies: the planner's count, the fixed total_tokens, or a static tree."""
        if planner is not None:
            return candidates.best(planner.choose(candidates.scores, levels))
        if self.options.kind == "dynamic" and self._custom_drafter is None:
            return candidates.best(self.options.total_tokens)
        return candidates.tree()

    def _observe(self, planner: Planner, candidates: Candidates, after: torch.Tensor, length: torch.Tensor) -> None:
        """Tell the planner which of the head's candidates (all it drafted, verified or not) spelled the tokens the
        target produced (after [B, A], left-aligned, length [B]), and what its levels held: one read of the device."""
        every = candidates.tree()
        on, known = on_continuation(every, after, length)
        parts = [every.scores[:, 1:].float(), on[:, 1:].float(), known[:, 1:].float()]
        parts += [x.float() for level in candidates.levels for x in level]
        host = torch.cat(parts, 1).cpu().numpy()  # [B, 3M + the levels' widths]
        pieces = np.split(host, np.cumsum([x.shape[1] for x in parts])[:-1], axis=1)
        scores, on, known = pieces[0], pieces[1] > 0, pieces[2] > 0
        planner.observe(np.exp(scores[known]), on[known])
        planner.observe_levels(list(zip(pieces[3::2], pieces[4::2])))

    def _lookup(self, head_nodes: int, index: list[NgramIndex], planner: Planner | None,
                lookup: int) -> tuple[list[list[int]], list[int]]:
        """Per row the n-gram branch to graft (maybe empty) onto a tree of head_nodes draft nodes, and the
        length of the match it came from."""
        if not lookup:
            return [], []
        found = [ix.continuation(lookup) for ix in index]
        if not any(n for _, n in found):
            return [], []
        # branch length per match length n (index n; no match, n = 0, gets none)
        planned = [lookup] * MAX_NGRAM if planner is None else planner.lookup_sizes(head_nodes)
        sizes = [0] + [min(lookup, k) for k in planned]
        return [c[: sizes[n]] for c, n in found], [n for _, n in found]
