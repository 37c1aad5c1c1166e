"""`eyas check-served`: does a serving engine draft what eyas's head drafts?

The head is exported for vLLM (or an export is taken as it is) and questions run through the engine, greedy,
rendered by the engine itself from chat messages as its chat endpoint would, every proposal's draft ids
recorded. Two things are then compared with eyas:

- the rendering: the prompt ids the engine decoded from against eyas's rendering of the same messages with its
  target's tokenizer (chat template, special tokens);
- the drafts, token by token: the engine's step s drafted after its prompt + the output tokens decided before
  it (the prefill decides the first; a step adds the drafts the output kept, plus one), so eyas's head drafts
  a greedy chain of k from that very context and each proposal is compared with it.

Where either differs, the likely causes are tried in eyas and named by what reproduces the engine: for the
rendering, the engine folder's own chat template, a BOS token added or dropped, special tokens added to the
rendered text, no generation prompt; for the drafts, eyas's head with its fused layer ids shifted by +-1 (all,
or one), its draft vocabulary map shifted by +-1 (in value or in position), a norm flag flipped, another rope
theta. Engines and kernels differ in rounding, so a few steps may differ at near-ties: `tolerance` is the share
of steps allowed to differ before the check fails.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from eyas.data.chat_template import encode_prompt
from eyas.models import DraftHead, Target

from .drafter import DraftContext, TreeOptions
from .drafting import make_drafter
from .runtimes_vllm import EngineRow, Step, steps_from_proposals

Prompt = Sequence[dict] | Sequence[int]  # chat messages (the engine renders them) or prompt ids
# runs the prompts through the engine with the head: one row per prompt, with its proposals
Engine = Callable[[list[Prompt]], list[EngineRow]]


class Decoded(NamedTuple):
    """One prompt as the engine decoded it: prompt + output ids, where the output starts, its drafting steps."""

    sequence: list[int]
    prompt_len: int
    steps: list[Step]


@dataclass(frozen=True)
class Candidate:
    """eyas's head as it is, or changed the way an export or an engine might have changed it."""

    label: str
    head: DraftHead


@dataclass
class CheckResult:
    prompts: int
    k: int
    tolerance: float
    rendering: list[dict[str, Any]] = field(default_factory=list)  # prompts whose ids differ: where and how
    rendering_cause: str | None = None  # the alternative rendering that reproduces the engine's ids
    rendering_tried: list[str] = field(default_factory=list)
    steps: int = 0  # proposals compared
    mismatched: int = 0  # proposals that differ from eyas's chain somewhere
    first: dict[str, Any] | None = None  # the first proposal that differs
    causes: list[dict[str, Any]] = field(default_factory=list)  # alternatives that reproduce the engine's drafts
    tried: list[dict[str, Any]] = field(default_factory=list)  # every alternative tried, with its match count

    @property
    def drafts_match(self) -> bool:
        return self.steps > 0 and self.mismatched <= self.tolerance * self.steps

    @property
    def passed(self) -> bool:
        return not self.rendering and self.drafts_match

    def lines(self) -> list[str]:
        """What the CLI prints: the rendering, the drafts, and the likely cause of any difference."""
        out = []
        if not self.rendering:
            out.append(f"rendering: the engine saw eyas's prompt ids for all {self.prompts} prompts")
        else:
            d = self.rendering[0]
            out.append(f"rendering: {len(self.rendering)} of {self.prompts} prompts differ; prompt {d['prompt']} first "
                       f"at token {d['at']}: eyas {d['eyas']!r}, engine {d['engine']!r}")
            out.append(f"  likely cause: {self.rendering_cause} (it reproduces the engine's prompt ids)"
                       if self.rendering_cause else
                       f"  no tried alternative reproduces the engine's prompt ids (tried: "
                       f"{'; '.join(self.rendering_tried)})")
        if self.steps == 0:
            out += ["drafts: the engine recorded no proposal to compare (no drafting step ran)", "check-served: FAIL"]
            return out
        verdict = "match" if self.drafts_match else "DIFFER"
        out.append(f"drafts: {self.steps - self.mismatched} of {self.steps} engine proposals (chains of {self.k}) "
                   f"equal eyas's head drafting from the same context: {verdict}"
                   + (f" (up to {100 * self.tolerance:.0f}% may differ at near-ties)" if self.mismatched else ""))
        if self.first is not None:
            f = self.first
            out.append(f"  first difference: prompt {f['prompt']}, step {f['step']} (after output token {f['done']}), "
                       f"draft position {f['position']}: engine {f['engine']}, eyas {f['eyas']}")
        if not self.drafts_match:
            if self.causes:
                for c in self.causes:
                    out.append(f"  likely cause: {c['label']} (eyas so reproduces {c['matched']} of {self.steps} "
                               "engine proposals)")
            else:
                best = max(self.tried, key=lambda t: t["matched"], default=None)
                out.append("  no tried alternative reproduces the engine's drafts"
                           + (f"; the closest, {best['label']}, matches {best['matched']} of {self.steps}"
                              if best else "")
                           + ": compare the served config.json with the head's (eyas export --format speculators)")
        out.append("check-served: " + ("PASS" if self.passed else "FAIL"))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


def check_served(target: Target, head: DraftHead, prompts: Sequence[Prompt], engine: Engine, k: int,
                 tolerance: float = 0.0, engine_tokenizer=None) -> CheckResult:
    """Run `prompts` through `engine` and compare its rendering and drafts with eyas's (module docstring).

    engine_tokenizer: the tokenizer of the model folder the engine serves, when it is not the target's (its chat
    template is then the first rendering tried)."""
    rows = engine(list(prompts))
    result = CheckResult(len(prompts), k, tolerance)
    _check_rendering(target.tokenizer, prompts, rows, result, engine_tokenizer)
    questions = [Decoded(list(row.prompt_token_ids) + list(row.tokens), len(row.prompt_token_ids),
                         steps_from_proposals(row.tokens, row.proposals or [])) for row in rows]
    found = _drafts(target, Candidate("eyas's head as it is", head), questions, k)
    for p, (q, ours) in enumerate(zip(questions, found)):
        for s, (step, mine) in enumerate(zip(q.steps, ours)):
            result.steps += 1
            if step.proposal != mine:
                result.mismatched += 1
                if result.first is None:
                    j = next(j for j, (a, b) in enumerate(zip(step.proposal, mine)) if a != b)
                    result.first = {"prompt": p, "step": s, "done": step.done, "position": j,
                                    "engine": step.proposal, "eyas": mine}
    if result.steps and not result.drafts_match:
        for candidate in alternatives(target, head):
            drafts = _drafts(target, candidate, questions, k)
            matched = sum(st.proposal == d for q, ds in zip(questions, drafts) for st, d in zip(q.steps, ds))
            result.tried.append({"label": candidate.label, "matched": matched})
            if result.steps - matched <= tolerance * result.steps:
                result.causes.append({"label": candidate.label, "matched": matched})
    return result


def _check_rendering(tokenizer, prompts: Sequence[Prompt], rows: list[EngineRow], result: CheckResult,
                     engine_tokenizer) -> None:
    chats = [(i, p, encode_prompt(tokenizer, p), list(row.prompt_token_ids))
             for i, (p, row) in enumerate(zip(prompts, rows)) if p and isinstance(p[0], dict)]
    differ = [(i, p, ours, theirs) for i, p, ours, theirs in chats if ours != theirs]
    for i, _, ours, theirs in differ:
        at = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        result.rendering.append({"prompt": i, "at": at, "eyas": tokenizer.decode(ours[at:at + 6]),
                                 "engine": tokenizer.decode(theirs[at:at + 6])})
    if not differ:
        return
    for label, render in renderings(tokenizer, engine_tokenizer):
        result.rendering_tried.append(label)
        if all(render(p) == theirs for _, p, _, theirs in differ):
            result.rendering_cause = label
            return


def renderings(tokenizer, engine_tokenizer=None) -> list[tuple[str, Callable[[Prompt], list[int]]]]:
    """The likely ways an engine renders chat messages otherwise than eyas, each as (what it is, the render)."""
    def text(chat, generation_prompt: bool = True) -> str:
        return tokenizer.apply_chat_template(list(chat), tokenize=False, add_generation_prompt=generation_prompt)

    out = []
    if engine_tokenizer is not None and engine_tokenizer.chat_template != tokenizer.chat_template:
        out.append(("the engine's model folder has another chat template than eyas's target",
                    lambda chat: encode_prompt(engine_tokenizer, chat)))
    bos = tokenizer.bos_token_id
    if bos is not None:
        out.append(("the engine adds a BOS token before the rendered prompt",
                    lambda chat: [bos] + encode_prompt(tokenizer, chat)))
        out.append(("the engine drops the BOS token the template writes",
                    lambda chat: [t for j, t in enumerate(encode_prompt(tokenizer, chat)) if j or t != bos]))
    out.append(("the engine tokenizes the rendered text with special tokens added",
                lambda chat: tokenizer(text(chat), add_special_tokens=True)["input_ids"]))
    out.append(("the engine renders without the generation prompt",
                lambda chat: tokenizer(text(chat, False), add_special_tokens=False)["input_ids"]))
    return out


def alternatives(target: Target, head: DraftHead) -> list[Candidate]:
    """eyas's head changed in each way that would make a served head draft otherwise (those its type has)."""
    c, n = head.config, target.num_layers
    changes: list[tuple[str, dict[str, Any]]] = []
    ids = c.fused_layer_ids
    for shift in (1, -1):
        if ids and all(0 <= i + shift <= n for i in ids):
            moved = tuple(i + shift for i in ids)
            changes.append((f"fused layer ids shifted by {shift:+d}: the engine fuses {list(moved)}, eyas's head "
                            f"{list(ids)}", {"fused_layer_ids": moved}))
    for j, i in enumerate(ids if len(ids) > 1 else ()):
        for shift in (1, -1):
            if 0 <= i + shift <= n and i + shift not in ids:
                moved = ids[:j] + (i + shift,) + ids[j + 1:]
                changes.append((f"fused layer id {i} read as {i + shift}: the engine fuses {list(moved)}, eyas's "
                                f"head {list(ids)}", {"fused_layer_ids": moved}))
    options = c.options
    for f in dataclasses.fields(options) if dataclasses.is_dataclass(options) else ():
        value = getattr(options, f.name)
        if "norm" in f.name and isinstance(value, bool):
            changes.append((f"{f.name} flipped: the engine runs the head with {f.name}={not value}",
                            {"options": dataclasses.replace(options, **{f.name: not value})}))
    for theta in sorted({10000.0, _rope_theta(target)} - {c.rope_theta, None}):
        changes.append((f"rope theta {theta:g} instead of the head's {c.rope_theta:g}", {"rope_theta": theta}))
    out = []
    for label, change in changes:
        try:
            variant = DraftHead(c.replace(**change), target)
        except ValueError:  # a combination the head type refuses (fc_norm with norm_before_fc, say)
            continue
        variant.load_state_dict(head.state_dict(), strict=False)  # a norm switched on keeps its unit weight
        out.append(Candidate(label, variant.to(head.fc.weight.dtype).eval()))
    if head.config.draft_vocab_size < head.config.vocab_size:
        d2t, v = head.draft_to_target, head.config.vocab_size
        for shift in (1, -1):
            out.append(Candidate(f"draft vocab map off by {shift:+d} in value: draft id i stands for target id "
                                 f"d2t[i] {shift:+d}", _with_map(head, target, (d2t + shift) % v)))
            out.append(Candidate(f"draft vocab map off by {shift:+d} in position: draft id i stands for the "
                                 f"target id of draft id i {shift:+d}", _with_map(head, target, d2t.roll(-shift))))
    return out


def _with_map(head: DraftHead, target: Target, draft_to_target: torch.Tensor) -> DraftHead:
    variant = DraftHead(head.config, target)
    variant.load_state_dict(head.state_dict())
    variant.set_vocab_map(draft_to_target)
    return variant.to(head.fc.weight.dtype).eval()


def _rope_theta(target: Target) -> float | None:
    text = target.model.config.get_text_config()
    theta = getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
    return None if theta is None else float(theta)


@torch.no_grad()
def _drafts(target: Target, candidate: Candidate, questions: list[Decoded], k: int) -> list[list[list[int]]]:
    """Per question, per step: the chain of k `candidate` drafts after the context that step drafted from. The
    target runs once per question over the whole sequence (causal: a position's states do not depend on what
    follows it)."""
    head = candidate.head
    drafter = make_drafter(head, TreeOptions(kind="chain", depth=k, lookup=0).expansion())
    out = []
    for seq, prompt_len, steps in questions:
        if not steps:
            out.append([])
            continue
        ids = torch.tensor([seq], device=target.device)
        features = target(ids[:, :-1], layer_ids=head.reads(target.num_layers), logits=False).features
        drafts = []
        for step in steps:
            end = prompt_len + step.done  # the context: prompt + the output decided before the step
            drafter.reset(1, end + k + 2)
            ctx = DraftContext(ids[:, 1:end], features[:, :end - 1], torch.arange(end - 1, device=ids.device)[None],
                               [end - 1])
            drafts.append(drafter.draft(ctx).tokens[0].tolist())
        out.append(drafts)
    return out
