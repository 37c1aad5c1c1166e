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
from eyas.models.kv_cache import KVCache
from eyas.models.masks import after_history
from eyas.models.sampling import Sampling

from .acceptance import Verifier, accept, penalized, verify
from .costs import CostModel, calibrate
from .drafter import Candidates, DraftContext, Drafter, DynamicExpansion, TreeOptions
from .drafting import make_drafter
from .lookup import MAX_NGRAM, NgramIndex, accepted_prefix, graft
from .planner import CyclePlan, Planner
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
        self.layer_ids = head.reads(target.num_layers)  # the target states the head reads
        self._custom_drafter = drafter
        self._drafters: dict[bool, Drafter] = {}  # chains only? -> the head's drafter for this generator's options
        self.planner: Planner | None = None  # decides each cycle's tree when options.planned
        if costs is not None:
            self.use_costs(costs)

    @classmethod
    def from_pretrained(cls, target: str | Target, head: str | DraftHead, dtype: str = "fp32",
                        device: str | torch.device = "cpu", compile: bool = False,
                        **tree_options) -> "SpeculativeGenerator":
        """target: a Target (used where it is) or a spec for Target.load (compile: its decode steps through
        torch.compile, see Target); head: a DraftHead or a head folder.
        tree_options: the fields of TreeOptions (kind, depth, top_k, total_tokens, paths, lookup)."""
        from eyas.models import load_head

        if isinstance(target, str):
            target = Target.load(target, dtype=dtype, device=device, compile=compile)
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
        drafter = make_drafter(self.head, DynamicExpansion(self.options.depth, self.options.top_k))
        costs = calibrate(self.target, drafter, self.encode(prompt), self.options.depth)
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

    @property
    def drafter(self) -> Drafter:
        """The drafter generations use: the head's, shaped for this target's verify mode, or the one given."""
        return self._drafter(self.target.verify_mode() == "chain")

    def _drafter(self, chains_only: bool) -> Drafter:
        """The drafter for this generator's options, kept across generations (its copies of the head's weights are
        built once); a target that verifies chains only gets the same expansion with one child per node."""
        if self._custom_drafter is not None:
            return self._custom_drafter
        if chains_only not in self._drafters:
            o = self.options
            if chains_only:
                expansion = DynamicExpansion(o.depth, 1) if o.kind == "dynamic" else TreeOptions(
                    "chain", o.depth).expansion()
            else:
                expansion = o.expansion()
            self._drafters[chains_only] = make_drafter(self.head, expansion)
        return self._drafters[chains_only]

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
        watch = Stopwatch(target.device)
        start = watch.mark()
        gen = torch.Generator(target.device).manual_seed(seed) if seed is not None else None
        longest = max(len(p) + r.max_new_tokens for p, r in zip(prompts, rows))
        target.check_length(longest)
        drafter = self._drafter(chains_only)
        lookup = 0 if chains_only else self.options.lookup  # a branch beside a chain would make a tree
        planner = None
        if self.options.planned and self._custom_drafter is None:
            if self.planner is None:
                self.calibrate(prompts[0])
            planner = self.planner
        capacity = longest + self.options.max_nodes() + 2
        batch, first, prefill_s = self._prefill(prompts, drafter, capacity, s, gen, watch, lookup)
        for r, st, tok in zip(rows, stats, first):
            st.prefill_time_s = st.target_time_s = prefill_s
            if not r.done:
                r.add([tok])
                st.prefill_tokens = 1
        if planner is not None:
            planner.begin(prefill_s)
        yield  # the first token, as soon as the prompt is read (a stream shows it before any cycle)

        while keep := [i for i, j in enumerate(batch.requests) if not rows[j].done]:
            if len(keep) < len(batch.requests):  # finished rows leave: no compute is spent on them any more
                batch.keep(keep)
            cycle = self._cycle(batch, planner, chains_only, lookup, s, gen, watch)
            for j, toks, depth in zip(batch.requests, cycle.gained, cycle.depths):
                rows[j].add(toks)
                st = stats[j]
                st.accepted.append(len(toks))
                st.drafted.append(cycle.nodes)
                st.depths.append(depth)
                st.draft_time_s += cycle.draft_s
                st.target_time_s += cycle.verify_s
            yield
        total = watch.between(start, watch.mark())
        for st in stats:
            st.total_time_s = total

    def _prefill(self, prompts: list[list[int]], drafter: Drafter, capacity: int, s: Sampling,
                 gen: torch.Generator | None, watch: Stopwatch, lookup: int) -> tuple["_Batch", list[int], float]:
        """Run every prompt into a new cache (right-padded: causal attention never reaches the padding) and choose
        the first generated token from the logits after its last token, by the rule a cycle's root-only verify
        uses. Returns (the batch, its first tokens, seconds); the drafter's first context is the prompts' states,
        EAGLE-shifted, so that the first token pairs with the last prompt position."""
        target, dev = self.target, self.target.device
        counts = [len(p) for p in prompts]
        cache = target.new_cache(len(prompts), capacity)
        drafter.reset(len(prompts), capacity)
        seen = None
        if s.repetition_penalty != 1.0:
            seen = torch.zeros(len(prompts), target.vocab_size, dtype=torch.bool, device=dev)
            for b, p in enumerate(prompts):
                seen[b, torch.tensor(p, device=dev)] = True
        width = max(counts)
        ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts], device=dev)  # [B, W]
        end = torch.tensor(counts, device=dev)[:, None] - 1  # [B, 1] each prompt's last column
        t0 = watch.mark()
        out = target(ids, cache=cache, layer_ids=self.layer_ids, logits=end)
        last = DraftTree.root_only(ids.gather(1, end)[:, 0])
        root = self._choices(out.logits, last, last.ancestors(), seen, s, gen)[:, 0]  # [B]
        cache.commit(counts)
        tokens = torch.cat([ids[:, 1:], ids[:, -1:]], 1).scatter_(1, end, root[:, None])
        positions = torch.arange(width, device=dev).expand(len(prompts), -1)
        if seen is not None:
            seen[torch.arange(len(prompts), device=dev), root] = True
        first = root.tolist()
        batch = _Batch(requests=list(range(len(prompts))), root=root,
                       unseen=[DraftContext(tokens, out.features, positions, counts)], behind=list(counts),
                       ngrams=[NgramIndex(p + [t]) for p, t in zip(prompts, first)] if lookup else [], seen=seen,
                       cache=cache, drafter=drafter)
        return batch, first, watch.between(t0, watch.mark())

    def _cycle(self, batch: "_Batch", planner: Planner | None, chains_only: bool, lookup: int, s: Sampling,
               gen: torch.Generator | None, watch: Stopwatch) -> "_Cycle":
        """One draft -> verify -> accept -> advance over the batch's rows."""
        target, cache, dev = self.target, batch.cache, self.target.device
        t0 = watch.mark()
        cycle_start = time.perf_counter()

        # 1. draft: the head's candidates, the plan's choice of them, and an n-gram branch
        plan = planner.plan(cache.width, max(batch.behind)) if planner is not None else None
        candidates = None
        if plan is None or plan.draft:
            candidates = batch.drafter.draft(batch.catch_up(), keep_going=plan.keep_drafting if plan else None)
            t_draft = watch.mark()
            tree = self._select(candidates, plan, chains_only)
        else:  # drafting does not pay at the moment: verify the root alone, the head skips this cycle
            tree = DraftTree.root_only(batch.root)
        chains, ngrams = self._lookup(tree.size - 1, batch.ngrams, plan, lookup)
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
        acc = accept(tree, self._choices(out.logits, tree, anc, batch.seen, s, gen), anc)
        path_tokens = tree.tokens.gather(1, acc.path)
        col = torch.arange(acc.path.shape[1], device=dev)
        last = col[None, :] == (acc.length - 1)[:, None]
        # EAGLE shift: the token after each path node is the next one, after the last the bonus
        after = torch.where(last, acc.bonus[:, None], torch.cat([path_tokens[:, 1:], acc.bonus[:, None]], 1))
        # the cycle's one read of the device after the verify: per row the tokens gained, the tree's depth, the
        # tokens, and what the planner learns from the candidates
        learned = self._learned(candidates, after, acc.length) if planner is not None and candidates is not None \
            else []
        host = _read([acc.length[:, None], tree.depth.max(1).values[:, None], after, *learned])
        lengths = [int(n) for n in host[0][:, 0]]
        gained = [[int(x) for x in row[:n]] for row, n in zip(host[2], lengths)]
        t2 = watch.mark()

        # 4. advance: keep the accepted path in the cache, hand its states to the drafter, record the tokens
        width = max(lengths)  # the path as wide as the longest row's (the drafter need not see the padding)
        path = acc.path[:, :width]
        cache.commit(lengths, path)
        feats = out.features
        batch.advance(DraftContext(tokens=after[:, :width], positions=positions.gather(1, path), counts=lengths,
                                   features=feats.gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))),
                      acc.bonus, gained)
        draft_s, verify_s = watch.between(t0, t1), watch.between(t1, t2)
        forwards = candidates.forwards if candidates is not None else 0
        if planner is not None:
            if learned:
                self._observe(planner, host[3:], plan.context)
            if any(chains):
                planner.observe_lookup([len(c) for c in chains],
                                       [accepted_prefix(c, g[:-1]) for c, g in zip(chains, gained)], ngrams)
            head_s = watch.between(t0, t_draft) if candidates is not None else 0.0
            planner.observe_cycle(plan, tree.size - 1, forwards, sum(lengths) / len(lengths), head_s,
                                  time.perf_counter() - cycle_start - head_s)
        return _Cycle(gained, [int(d) for d in host[1][:, 0]], tree.size - 1, draft_s, verify_s)

    def _choices(self, logits: torch.Tensor, tree: DraftTree, ancestors: torch.Tensor, seen: torch.Tensor | None,
                 s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
        """The target's choice y [B, N] at every node of a verified tree (logits [B, N, V]): the repetition
        penalty over what each node follows, then the verifier's rule."""
        if seen is not None:
            logits = penalized(logits, tree, ancestors, seen, s.repetition_penalty)
        return self.verifier(logits, tree, s, gen)

    def _select(self, candidates: Candidates, plan: CyclePlan | None, chains_only: bool) -> DraftTree:
        """Which candidates the target verifies: the plan's count, the fixed total_tokens, or a static tree; on a
        target that verifies chains only, the best path (as long as the plan finds it pays)."""
        if chains_only:
            chain = candidates.chain()
            if plan is None:
                return chain
            return chain.prefix(plan.choose(chain.scores[:, 1:], candidates.forwards))
        if plan is not None:
            return candidates.best(plan.choose(candidates.scores, candidates.forwards))
        if self.options.kind == "dynamic" and self._custom_drafter is None:
            return candidates.best(self.options.total_tokens)
        return candidates.tree()

    @staticmethod
    def _learned(candidates: Candidates, after: torch.Tensor, length: torch.Tensor) -> list[torch.Tensor]:
        """What the planner learns from a draft (on the device, read with the rest of the cycle): which of the head's
        candidates (all it drafted, verified or not) spelled the tokens the target produced (after [B, A],
        left-aligned, length [B]), their scores, and what its levels held."""
        every = candidates.tree()
        on, known = on_continuation(every, after, length)
        parts = [every.scores[:, 1:], on[:, 1:], known[:, 1:]]
        return parts + [x for level in candidates.levels for x in level]

    @staticmethod
    def _observe(planner: Planner, host: list[np.ndarray], context: int) -> None:
        scores, on, known = host[0], host[1] > 0, host[2] > 0
        planner.observe(np.exp(scores[known]), on[known])
        planner.observe_levels(list(zip(host[3::2], host[4::2])), context)

    def _lookup(self, head_nodes: int, index: list[NgramIndex], plan: CyclePlan | None,
                lookup: int) -> tuple[list[list[int]], list[int]]:
        """Per row the n-gram branch to graft (maybe empty) onto a tree of head_nodes draft nodes, and the
        length of the match it came from."""
        if not lookup:
            return [], []
        found = [ix.continuation(lookup) for ix in index]
        if not any(n for _, n in found):
            return [], []
        # branch length per match length n (index n; no match, n = 0, gets none)
        planned = [lookup] * MAX_NGRAM if plan is None else plan.lookup_sizes(head_nodes)
        sizes = [0] + [min(lookup, k) for k in planned]
        return [c[: sizes[n]] for c, n in found], [n for _, n in found]


@dataclass
class _Batch:
    """What the cycle keeps per row of the batch; rows that finish leave it together (`keep`)."""

    requests: list[int]  # batch row -> its request's index in the caller's rows and stats
    root: torch.Tensor  # [B] the last accepted token, which the target has not seen yet
    unseen: list[DraftContext]  # what the drafter has not seen yet, oldest first: it catches up on all when it drafts
    behind: list[int]  # per row: how many tokens that is
    ngrams: list[NgramIndex]  # per row, the n-grams of its sequence for lookup branches ([] without lookup)
    seen: torch.Tensor | None  # [B, V] bool: the tokens of each sequence (the repetition penalty), None without one
    cache: KVCache  # the target's
    drafter: Drafter  # with the head's cache, column for column with the target's

    def keep(self, keep: list[int]) -> None:
        """Only rows `keep` go on; the caches move the last kept rows into the holes, every field follows."""
        order = self.cache.keep_rows(keep)  # `order`: the old row now in each row
        self.drafter.keep_rows(order)
        idx = torch.tensor(order, device=self.root.device)
        self.requests, self.root = [self.requests[i] for i in order], self.root[idx]
        self.unseen = [c.rows(order) for c in self.unseen]
        self.behind = [self.behind[i] for i in order]
        self.ngrams = [self.ngrams[i] for i in order] if self.ngrams else []
        self.seen = self.seen[idx] if self.seen is not None else None

    def catch_up(self) -> DraftContext:
        """All the drafter has not seen, as one context; from now on it is seen."""
        ctx = DraftContext.join(self.unseen)
        self.unseen, self.behind = [], [0] * len(self.behind)
        return ctx

    def advance(self, accepted: DraftContext, bonus: torch.Tensor, gained: list[list[int]]) -> None:
        """A cycle accepted `accepted` (EAGLE-shifted; per row `gained` tokens) and the target chose `bonus` [B]."""
        self.unseen.append(accepted)
        self.behind = [n + len(g) for n, g in zip(self.behind, gained)]
        self.root = bonus
        if self.seen is not None:
            width = accepted.tokens.shape[1]
            col = torch.arange(width, device=bonus.device)
            counts = torch.tensor(accepted.counts, device=bonus.device)
            self.seen.scatter_(1, torch.where(col[None, :] < counts[:, None], accepted.tokens,
                                              accepted.tokens[:, :1]), True)
        for ix, toks in zip(self.ngrams, gained):
            ix.extend(toks)


@dataclass
class _Cycle:
    """What one cycle gave each row: its tokens, the depth of the tree it verified; and what it cost."""

    gained: list[list[int]]
    depths: list[int]
    nodes: int  # draft nodes verified (0: plain decoding)
    draft_s: float
    verify_s: float


def _read(parts: list[torch.Tensor]) -> list[np.ndarray]:
    """Tensors [B, n_i] of the device as host arrays, in one read (float64 holds token ids exactly)."""
    host = torch.cat([p.to(torch.float64) for p in parts], 1).cpu().numpy()
    return np.split(host, np.cumsum([p.shape[1] for p in parts])[:-1], axis=1)
