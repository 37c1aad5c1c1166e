"""EAGLE-1/EAGLE-3 losses: the TTT mask as a literal matrix, TTT equals step-by-step drafting,
the optimised losses equal the every-position reference (train/losses_reference.py) in value and gradients,
out-of-draft-vocab positions are counted, and the acceptance-length estimate."""

import functools

import pytest
import torch

from eyas.models import DraftHead, algorithm, head_config_for
from eyas.models.drafters import NAMES
from eyas.models.layers import attend
from eyas.models.masks import additive, causal
from eyas.models.ttt import TTTAttention
from eyas.train.config import LossConfig
from eyas.train.losses import acceptance, drafter_loss, soft_cross_entropy
from eyas.train.losses_reference import dflash_loss as reference_dflash
from eyas.train.losses_reference import eagle1_loss as reference_eagle1
from eyas.train.losses_reference import eagle3_loss as reference_eagle3
from eyas.train.losses_reference import soft_ce as reference_soft_ce
from eyas.train.losses_reference import unroll as reference_unroll
from tests.helpers.tiny import tiny_target


def test_ttt_cache_attends_like_the_literal_mask():
    """TTTAttention over steps 0 (batched), 1 and 2 (packed rows of two batch elements) equals dense
    attention under the literal [causal | eye | eye] masks of each batch element."""
    torch.manual_seed(0)
    b, heads, kv, d, n = 2, 4, 2, 8, 3
    keys = [(torch.randn(b, kv, n, d), torch.randn(b, kv, n, d)) for _ in range(3)]  # per step, at every (b, t)
    q = torch.randn(b, heads, n, d)

    def packed(x):  # [B, h, n, D] -> [1, h, B*n, D], rows ordered by batch element
        return x.transpose(0, 1).reshape(1, x.shape[1], b * n, d)

    cache = TTTAttention(1)
    cache.update(*keys[0], 0)
    every = torch.ones(b * n, dtype=torch.bool)
    cache.next_step(torch.arange(n).repeat(b), [n, n], every)
    cache.attend(0, packed(q), packed(keys[1][0]), packed(keys[1][1]))
    keep = torch.tensor([False, True, False, True, False, True])  # step 2 rows: (0, 1), (1, 0), (1, 2)
    bi, ti = torch.tensor([0, 1, 1]), torch.tensor([1, 0, 2])
    cache.next_step(ti, [1, 2], keep)
    k2, v2 = (x[bi, :, ti].transpose(0, 1)[None] for x in keys[2])  # [1, kv, 3, D]
    out = cache.attend(0, q[bi, :, ti].transpose(0, 1)[None], k2, v2)[0]  # [heads, 3, D]
    allowed = {0: torch.tensor([[1, 1, 0, 0, 1, 0, 1]]),
               1: torch.tensor([[1, 0, 0, 1, 0, 0, 1, 0],
                                [1, 1, 1, 0, 0, 1, 0, 1]])}
    for e, rows in ((0, [0]), (1, [1, 2])):
        dense_k = torch.cat([keys[0][0][e], keys[1][0][e], k2[0][:, rows]], dim=1)[None]
        dense_v = torch.cat([keys[0][1][e], keys[1][1][e], v2[0][:, rows]], dim=1)[None]
        mask = additive(allowed[e][None].bool(), torch.float32)
        expected = attend(q[e][:, ti[rows]][None], dense_k, dense_v, mask)
        assert torch.allclose(out[:, rows], expected[0], atol=1e-6), e


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=64), target)
    head.set_vocab_map(torch.arange(0, 128, 2))  # even ids only
    ids = torch.randint(4, 300, (2, 10))
    out = target(ids, layer_ids=head.config.fused_layer_ids)
    return target, head, ids, out


def test_ttt_step_equals_sequential_drafting(setup):
    """Step i at index t must be what inference computes: prefix 0..t, then i fed-back steps."""
    target, head, ids, out = setup
    with torch.no_grad():
        hidden0 = head.fuse(out.features[:, :-1])
        steps = reference_unroll(head, ids, hidden0, 3)
        for t in (0, 4, 6):
            cache = head.new_cache(2, 16)
            o = head(ids[:, 1:t + 2], hidden0[:, :t + 1], torch.arange(t + 1).expand(2, -1),
                     causal(t + 1).expand(2, -1, -1), cache)
            assert torch.allclose(o.logits[:, t], steps[0].logits[:, t], atol=1e-5)
            hidden = o.hidden[:, t:t + 1]
            for i in (1, 2):
                # the inference cache holds only the prefix 0..t and this chain's earlier steps: see all of it
                mask = torch.ones(2, 1, cache.width + 1, dtype=torch.bool)
                o = head(ids[:, t + 1 + i: t + 2 + i], hidden, torch.full((2, 1), t + i), mask, cache)
                assert torch.allclose(o.logits[:, 0], steps[i].logits[:, t], atol=1e-5), (t, i)
                hidden = o.hidden


def test_ttt_loss_counts_out_of_vocab_and_masks_invalid(setup):
    target, head, ids, out = setup
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 6:] = False
    loss, m = drafter_loss(head, ids, valid, out.features, out.logits, LossConfig(ttt_steps=3))
    assert torch.isfinite(loss) and loss > 0
    assert m["count/step0"].item() == 9 + 5 and m["count/step2"].item() == 7 + 3
    top = out.logits.argmax(-1)
    odd_or_big = ((top % 2 == 1) | (top >= 128)) & valid
    assert m["oov/step0"].item() == odd_or_big[:, 1:].sum().item()
    loss.backward()
    assert head.fc.weight.grad is not None
    assert all(p.grad is None for p in target.parameters())


def test_soft_cross_entropy_is_minimised_by_the_target_distribution():
    """Soft CE against itself is minimised: a head whose logits equal the target's gives the entropy."""
    logits = torch.randn(3, 7)
    p = torch.softmax(logits, -1)
    entropy = -(p * p.log()).sum(-1)
    assert torch.allclose(soft_cross_entropy(logits, logits), entropy, atol=1e-6)
    assert (soft_cross_entropy(torch.randn(3, 7), logits) > entropy).all()


def test_soft_cross_entropy_value_and_gradient_equal_torch():
    logits = torch.randn(2, 150, 11, requires_grad=True)  # 300 rows: more than one block of the fused CE
    teacher = torch.randn(2, 150, 11)
    weight = torch.rand(2, 150)  # an uneven upstream gradient
    results = []
    for fn in (soft_cross_entropy, reference_soft_ce):
        logits.grad = None
        ce = fn(logits, teacher)
        (ce * weight).sum().backward()
        results.append((ce.detach(), logits.grad.clone()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)
    with pytest.raises(ValueError, match="must not require grad"):
        soft_cross_entropy(logits, teacher.requires_grad_())


def test_eagle1_loss_reads_next_feature_and_counts_top1():
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, "eagle1"), target)
    ids = torch.randint(4, 300, (2, 8))
    out = target(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    loss, m = drafter_loss(head, ids, valid, out.hidden, out.logits, LossConfig(ce_weight=0.1))
    assert m["count/step0"].item() == 2 * 7
    feature_only, _ = drafter_loss(head, ids, valid, out.hidden, out.logits, LossConfig(ce_weight=0.0))
    assert loss > feature_only > 0


def test_acceptance_chain_estimate():
    m = {"correct/step0": 8.0, "count/step0": 10.0, "oov/step0": 1.0,
         "correct/step1": 5.0, "count/step1": 10.0, "oov/step1": 0.0}
    a = acceptance(m)
    assert a["acc/step0"] == pytest.approx(0.8) and a["oov/step0"] == pytest.approx(0.1)
    assert a["tau"] == pytest.approx(1 + 0.8 + 0.8 * 0.5)


def _grads(head):
    return {k: p.grad.clone() for k, p in head.named_parameters() if p.grad is not None}


def _head_and_states(target, head_type: str, length: int, **head_kw):
    """A seeded random head over `target` (with an lm_head of its own: a 64-token draft vocabulary), 3 random sequences
    of `length` tokens, the target's outputs on them and the states the head reads."""
    torch.manual_seed(0)
    reduced = algorithm(head_type).reduced_vocab
    head = DraftHead(head_config_for(target, head_type, draft_vocab_size=64 if reduced else None, **head_kw), target)
    if reduced:
        head.set_vocab_map(torch.arange(0, 128, 2))
    ids = torch.randint(4, 300, (3, length))
    out = target(ids, layer_ids=head.reads(target.num_layers))
    return head, ids, out, out.features


# EAGLE-3.1's norms: one per fused state before the fc, and the post-norm state fed to the next step
EAGLE31 = {"fc_norm": True, "norm_output": True}
# P-EAGLE with every row of every depth kept (the reference evaluates every depth at every anchor)
PEAGLE_ALL = {"depths": 4, "depth_keep": 1.0, "depth_keep_min": 1.0}
# DFlash with a block at every anchor (the reference runs each anchor's block alone)
DFLASH_ALL = {"block_size": 4, "anchors": 64}


@pytest.mark.parametrize("head_type, arch, layers, window, options", [
    ("eagle3", "llama", 1, None, {}), ("eagle3", "qwen2", 1, None, {}), ("eagle3", "llama", 2, None, {}),
    ("eagle1", "llama", 1, None, {}), ("eagle1", "qwen2", 1, None, {}),
    ("eagle3", "llama", 2, 2, {}),  # a head with its own sliding window, shorter than the TTT unroll
    ("eagle3", "llama", 2, None, EAGLE31), ("eagle3", "qwen2", 1, None, {"norm_before_fc": True}),
    ("peagle", "llama", 2, None, PEAGLE_ALL), ("peagle", "qwen2", 2, 2, {**PEAGLE_ALL, **EAGLE31}),
    ("dflash", "llama", 2, None, DFLASH_ALL), ("dflash", "qwen3", 1, None, {**DFLASH_ALL, "block_size": 3}),
])
def test_optimised_loss_and_gradients_equal_the_reference(head_type, arch, layers, window, options):
    """Loss, metrics and every gradient match the every-index reference, with prompt/assistant/padding
    masks that leave some rows without loss at late steps, indices at the end that lead to no loss
    (trimmed), step-0 rows that only leave keys/values, and one row without any loss. With two
    layers the first one must still run at every index (the second reads its keys/values)."""
    target = tiny_target(arch)
    head, ids, out, states = _head_and_states(target, head_type, 14, num_layers=layers, sliding_window=window,
                                              options=options)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[0, 3:7] = valid[0, 10:12] = True  # two assistant turns
    valid[1, 5:9] = True  # then padding
    config = LossConfig(ttt_steps=4, feature_noise=0.1)
    reference = {"eagle3": reference_eagle3, "eagle1": reference_eagle1,
                 "peagle": functools.partial(reference_eagle3, masked=True), "dflash": reference_dflash}[head_type]
    fast = drafter_loss
    results = []
    for fn in (fast, reference):
        head.zero_grad()
        torch.manual_seed(1)  # the same feature noise
        loss, metrics = fn(head, ids, valid, states, out.logits, config)
        loss.backward()
        results.append((loss.detach(), metrics, _grads(head)))
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = results
    assert loss > 0 and torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert metrics.keys() == ref_metrics.keys()
    for k in metrics:
        assert torch.allclose(metrics[k].float(), ref_metrics[k].float(), rtol=1e-5, atol=1e-5), k
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(head.parameters()))
    for k in grads:
        assert torch.allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6), (k, (grads[k] - ref_grads[k]).abs().max())


def test_ttt_loss_without_any_loss_position_is_zero(setup):
    """A micro-batch of prompt tokens only (nothing to learn) gives a zero loss and zero gradients
    instead of failing on empty step rows."""
    target, head, ids, out = setup
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[:, 0] = True  # index 0 is never predicted
    loss, m = drafter_loss(head, ids, valid, out.features, out.logits, LossConfig(ttt_steps=3))
    head.zero_grad()
    loss.backward()
    assert loss.item() == 0 and all(m[f"count/step{i}"].item() == 0 for i in range(3))
    assert all(p.grad is None or not p.grad.any() for p in head.parameters())


@pytest.mark.parametrize("head_type", ["eagle3", "eagle1"])
def test_teacher_rows_through_the_targets_own_head_equal_full_logits(head_type):
    """The trainer's teacher (the target's logits of chosen hidden rows, `Target.logits`) gives the loss, metrics
    and gradients of the full [B, T, V] logits, and is asked only for rows that carry loss."""
    target = tiny_target("llama")
    head, ids, out, states = _head_and_states(target, head_type, 12)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    valid[0, 2:6] = valid[1, 7:] = True
    asked = []

    def teacher(rows):
        asked.append(rows.clone())
        return target.logits(out.hidden.flatten(0, 1).index_select(0, rows))

    fn = drafter_loss
    results = []
    for given in (out.logits, teacher):
        head.zero_grad()
        loss, metrics = fn(head, ids, valid, states, given, LossConfig(ttt_steps=3))
        loss.backward()
        results.append((loss.detach(), metrics, _grads(head)))
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = results[1], results[0]
    assert torch.allclose(loss, ref_loss, rtol=1e-5) and metrics.keys() == ref_metrics.keys()
    assert all(torch.allclose(metrics[k], ref_metrics[k], rtol=1e-5) for k in metrics)
    assert all(torch.allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-7) for k in grads)
    rows = torch.cat(asked)
    assert set(rows.tolist()) == set(valid.flatten().nonzero().squeeze(1).tolist()) - {0, 12, 24}  # index 0: never


@pytest.mark.parametrize("head_type", NAMES)
def test_the_loss_module_embeds_a_batch_once_and_equals_the_loss(head_type):
    """DistillationLoss gives the head the batch's embedding rows and its own tokens' (a mask token, never in the
    batch), looked up once (a sharded embedding is then gathered once per micro-batch, not once per unroll step):
    same loss and gradients as the head's own lookups."""
    from eyas.train.losses import DistillationLoss

    target = tiny_target("llama")
    head, ids, out, states = _head_and_states(target, head_type, 12)
    ids = ids[:2] % 200 + 4  # none of them the mask token
    out = target(ids, layer_ids=head.reads(target.num_layers))
    assert not set(head.own_tokens) & set(ids.flatten().tolist())
    valid = torch.ones_like(ids, dtype=torch.bool)
    config = LossConfig(ttt_steps=4)
    seeds = [0, 1]  # the same random choices on both paths
    calls = []
    hook = target.embed_tokens.register_forward_hook(lambda *_: calls.append(1))
    results = []
    for fn in (lambda: DistillationLoss(head, config)(ids, valid, out.features, out.logits, seeds),
               lambda: drafter_loss(head, ids, valid, out.features, out.logits, config, seeds)):
        head.zero_grad()
        calls.clear()
        loss, _ = fn()
        loss.backward()
        results.append((loss.detach(), _grads(head), len(calls)))
    hook.remove()
    (loss, grads, embedded), (ref_loss, ref_grads, ref_embedded) = results
    assert embedded == 1 <= ref_embedded  # once per batch vs once per step
    assert torch.allclose(loss, ref_loss)
    for k in grads:  # fp32 along two paths (one lookup's slices, or a lookup per step): equal up to rounding
        torch.testing.assert_close(grads[k], ref_grads[k])
    assert head.shared["embed_tokens"] is target.embed_tokens  # given back
