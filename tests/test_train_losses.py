"""EAGLE-1/EAGLE-3 losses: the TTT mask as a literal matrix, TTT equals step-by-step drafting,
out-of-draft-vocab positions are counted, and the acceptance-length estimate."""

import pytest
import torch

from tiny import tiny_target

from eyas.models import DraftHead, head_config_for
from eyas.train.config import LossConfig
from eyas.train.losses import acceptance, eagle1_loss, eagle3_ttt_loss, ttt_mask, ttt_unroll


def test_ttt_mask_literal():
    expected = torch.tensor([
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ttt_mask(3, 2, 1, torch.device("cpu"))[0], expected)


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
        steps = ttt_unroll(head, ids, hidden0, 3)
        for t in (0, 4, 6):
            cache = head.new_cache()
            o = head(ids[:, 1:t + 2], hidden0[:, :t + 1], torch.arange(t + 1).expand(2, -1), None, cache)
            assert torch.allclose(o.logits[:, t], steps[0].logits[:, t], atol=1e-5)
            hidden = o.hidden[:, t:t + 1]
            for i in (1, 2):
                # the inference cache holds only the prefix 0..t and this chain's earlier steps: see all of it
                mask = torch.ones(2, 1, len(cache) + 1, dtype=torch.bool)
                o = head(ids[:, t + 1 + i: t + 2 + i], hidden, torch.full((2, 1), t + i), mask, cache)
                assert torch.allclose(o.logits[:, 0], steps[i].logits[:, t], atol=1e-5), (t, i)
                hidden = o.hidden


def test_ttt_loss_counts_out_of_vocab_and_masks_invalid(setup):
    target, head, ids, out = setup
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 6:] = False
    loss, m = eagle3_ttt_loss(head, ids, valid, out.features, out.logits, LossConfig(ttt_steps=3))
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
    from eyas.train.losses import soft_cross_entropy

    logits = torch.randn(3, 7)
    p = torch.softmax(logits, -1)
    entropy = -(p * p.log()).sum(-1)
    assert torch.allclose(soft_cross_entropy(logits, logits), entropy, atol=1e-6)
    assert (soft_cross_entropy(torch.randn(3, 7), logits) > entropy).all()


def test_eagle1_loss_reads_next_feature_and_counts_top1():
    target = tiny_target("llama")
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, "eagle1"), target)
    ids = torch.randint(4, 300, (2, 8))
    out = target(ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    loss, m = eagle1_loss(head, ids, valid, out.hidden, out.logits, LossConfig(ce_weight=0.1))
    assert m["count/step0"].item() == 2 * 7
    feature_only, _ = eagle1_loss(head, ids, valid, out.hidden, out.logits, LossConfig(ce_weight=0.0))
    assert loss > feature_only > 0


def test_acceptance_chain_estimate():
    m = {"correct/step0": 8.0, "count/step0": 10.0, "oov/step0": 1.0,
         "correct/step1": 5.0, "count/step1": 10.0, "oov/step1": 0.0}
    a = acceptance(m)
    assert a["acc/step0"] == pytest.approx(0.8) and a["oov/step0"] == pytest.approx(0.1)
    assert a["tau"] == pytest.approx(1 + 0.8 + 0.8 * 0.5)
