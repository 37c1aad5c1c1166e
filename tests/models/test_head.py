import json

import pytest
import torch

from eyas.models import DraftHead, HeadConfig, HeadTargetMismatch, load_head, save_head
from eyas.models.head_config import head_config_for
from tests.helpers.tiny import FIXTURES, tiny_target


def _draft_logits(head, target, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 300, (2, 7), generator=g)
    out = target(ids, layer_ids=head.config.fused_layer_ids)
    feat = out.features if head.config.head_type == "eagle3" else out.hidden
    pos = torch.arange(7).expand(2, -1)
    return head(ids, head.fuse(feat), pos).logits


@pytest.mark.parametrize("head_type", ["eagle1", "eagle3"])
@pytest.mark.parametrize("arch,tied", FIXTURES)
def test_save_load_gives_identical_logits(tmp_path, arch, tied, head_type):
    target = tiny_target(arch, tied)
    torch.manual_seed(1)
    head = DraftHead(head_config_for(target, head_type, draft_vocab_size=100), target)
    if head_type == "eagle3":
        head.set_vocab_map(torch.randperm(target.vocab_size)[:100])
    save_head(head, tmp_path / "h")
    again = load_head(tmp_path / "h", target)
    assert again.config == head.config
    torch.testing.assert_close(_draft_logits(again, target), _draft_logits(head, target), rtol=0, atol=0)
    saved = json.loads((tmp_path / "h" / "config.json").read_text())
    assert saved["target"]["tokenizer_fingerprint"].startswith("sha256:")


def test_exported_weights_exclude_borrowed_modules(tmp_path):
    from safetensors.torch import load_file

    target = tiny_target("llama", True)
    save_head(DraftHead(head_config_for(target, "eagle1"), target), tmp_path / "h")
    keys = load_file(str(tmp_path / "h" / "model.safetensors")).keys()
    assert not any("embed" in k for k in keys) and "lm_head.weight" not in keys


def test_mismatched_target_errors_name_the_problem(tmp_path):
    target = tiny_target("llama")
    head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=64), target)
    save_head(head, tmp_path / "h")
    with pytest.raises(HeadTargetMismatch, match="vocab size"):
        load_head(tmp_path / "h", tiny_target("llama", vocab_size=384))
    wider = tiny_target("llama")
    wider.hidden_size = 96  # a differently shaped model, as far as the check can tell
    with pytest.raises(HeadTargetMismatch, match="hidden size"):
        load_head(tmp_path / "h", wider)
    other_tok = tiny_target("llama")
    other_tok.tokenizer.add_tokens(["brand-new-token"])
    with pytest.raises(HeadTargetMismatch, match="tokenizer"):
        load_head(tmp_path / "h", other_tok)
    shallow = tiny_target("llama", num_layers=1)
    with pytest.raises(HeadTargetMismatch, match="layer"):
        load_head(tmp_path / "h", shallow)


def test_interrupted_save_keeps_old_head(tmp_path, monkeypatch):
    import eyas.models.layouts.eyas as hf

    target = tiny_target("llama")
    head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=64), target)
    save_head(head, tmp_path / "h")
    before = (tmp_path / "h" / "model.safetensors").read_bytes()

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf, "save_file", crash)
    with torch.no_grad():
        head.fc.weight.add_(1)
    with pytest.raises(KeyboardInterrupt):
        save_head(head, tmp_path / "h")
    assert (tmp_path / "h" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]


def test_bad_config_errors():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="unknown head config keys"):
        HeadConfig.from_dict({**head_config_for(target, "eagle1").to_dict(), "hiden_size": 3})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        head_config_for(target, "eagle3", draft_vocab_size=10_000)
    with pytest.raises(ValueError, match="config.json"):
        load_head("/nonexistent/head")


@pytest.mark.parametrize("norm_before_residual,window", [(False, None), (True, None), (True, 3)])
def test_drafting_through_the_cache_matches_one_masked_block(norm_before_residual, window):
    """Token by token through the KV cache (the head's own window applied there) == one block under an explicit
    causal (and windowed) mask, for the norm_before_residual variant too."""
    import dataclasses

    from eyas.models.masks import after_history

    target = tiny_target("llama", num_layers=8)
    config = dataclasses.replace(head_config_for(target, "eagle3", draft_vocab_size=100),
                                 options={"norm_before_residual": norm_before_residual}, sliding_window=window)
    torch.manual_seed(2)
    head = DraftHead(config, target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(4, 300, (1, 7), generator=torch.Generator().manual_seed(0))
    hidden = head.fuse(target(ids, layer_ids=config.fused_layer_ids).features)
    pos = torch.arange(7)[None]
    q, k = pos[0][:, None], pos[0][None, :]
    allowed = (k <= q) & ((q - k < window) if window else True)
    block = head(ids, hidden, pos, allowed[None]).logits
    cache = head.new_cache(1, 16)
    steps = []
    for t in range(7):
        mask = after_history(cache.lengths, torch.ones(1, 1, 1, dtype=torch.bool), cache.width + 1)
        steps.append(head(ids[:, t:t + 1], hidden[:, t:t + 1], pos[:, t:t + 1], mask, cache).logits)
        cache.commit([1])
    torch.testing.assert_close(torch.cat(steps, dim=1), block, rtol=1e-5, atol=1e-5)


def test_a_head_with_its_own_window_drafts_what_its_paths_compute_alone():
    """A head with `sliding_window` (released EAGLE-3 heads for sliding-window targets carry one): every draft node's
    score, over two cycles, equals running the head along that node's path alone, in one cache-free forward per step
    under a dense mask of that window; without the window the same reference disagrees."""
    from eyas.inference.drafter import DraftContext, TreeOptions
    from eyas.inference.drafting import TreeDrafter

    target = tiny_target("llama")
    window = 4
    torch.manual_seed(0)
    head = DraftHead(head_config_for(target, "eagle3", sliding_window=window), target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 300, (1, 17), generator=g)
    features = target(ids, layer_ids=head.config.fused_layer_ids).features
    drafter = TreeDrafter(head, TreeOptions(total_tokens=12, top_k=3, depth=4).expansion())
    drafter.reset(1, 64)

    def context(a, b):  # EAGLE shift: the feature at position t goes with token t + 1
        return DraftContext(ids[:, a + 1:b + 1], features[:, a:b], torch.arange(a, b)[None], [b - a])

    def reference_score(upto, path, window):
        """Cumulative draft log-probability of `path` (tokens) after the first upto + 1 tokens, step by step."""
        tokens, hidden = ids[:, 1:upto + 1], head.fuse(features[:, :upto])
        score = 0.0
        for tok in path:
            pos = torch.arange(tokens.shape[1])
            allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
            out = head(tokens, hidden, pos[None], allowed[None])
            score += float(torch.log_softmax(out.logits[0, -1].float(), -1)[tok])
            tokens = torch.cat([tokens, torch.tensor([[tok]])], 1)
            hidden = torch.cat([hidden, out.hidden[:, -1:]], 1)
        return score

    mismatches_without_window = 0
    with torch.no_grad():
        for a, b in ((0, 12), (12, 15)):  # the prompt, then three accepted tokens
            tree = drafter.draft(context(a, b)).tree()
            for i in range(1, tree.size):
                path, node = [], i
                while node > 0:
                    path.append(int(tree.tokens[0, node]))
                    node = int(tree.parents[0, node])
                path.reverse()
                assert abs(reference_score(b, path, window) - float(tree.scores[0, i])) < 1e-4, (b, i)
                mismatches_without_window += abs(reference_score(b, path, 10 ** 6) - float(tree.scores[0, i])) > 1e-4
    assert mismatches_without_window > 0


def test_a_parallel_drafter_proposes_through_its_cache_what_one_masked_block_computes():
    """P-EAGLE: catch-ups of rows of different lengths through the head's cache, then one forward with k - 1 masked
    positions, give the logits of one block over the whole context under the literal mask (the context causal;
    masked position d seeing the context and masked positions <= d), and keep only the real entries."""
    target = tiny_target("llama", num_layers=6)
    torch.manual_seed(3)
    head = DraftHead(head_config_for(target, "peagle", draft_vocab_size=100, num_layers=2), target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    k, lengths = 4, [9, 6]
    ids = torch.randint(4, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    features = target(ids, layer_ids=head.config.fused_layer_ids).features
    pos = torch.arange(10).expand(2, -1)
    cache = head.new_cache(2, 32)
    first = [5, 3]  # seen in an earlier cycle, then the rest up to each row's root
    head.propose(ids[:, :5], features[:, :5], pos[:, :5], first, cache, k)
    assert cache.host_lengths == first
    rest = [n - f for n, f in zip(lengths, first)]
    take = torch.stack([torch.cat([torch.arange(f, n), torch.full((max(rest) - (n - f),), n - 1)])
                        for f, n in zip(first, lengths)])
    got = head.propose(ids.gather(1, take), features.gather(1, take[..., None].expand(-1, -1, features.shape[-1])),
                       pos.gather(1, take), rest, cache, k)
    assert cache.host_lengths == lengths
    for b, n in enumerate(lengths):  # each row alone, one block without a cache
        mask_ids, mask_state = head.mask_inputs((1, k - 1), ids.device)
        block_ids = torch.cat([ids[b:b + 1, :n], mask_ids], 1)
        state = torch.cat([head.fuse(features[b:b + 1, :n]), mask_state], 1)
        positions = torch.cat([pos[b:b + 1, :n], n - 1 + torch.arange(1, k)[None]], 1)
        allowed = torch.zeros(1, n + k - 1, n + k - 1, dtype=torch.bool)
        allowed[:, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        allowed[:, n:, :n] = True
        allowed[:, n:, n:] = torch.ones(k - 1, k - 1, dtype=torch.bool).tril()
        want = head(block_ids, state, positions, allowed).logits[0, n - 1:]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_a_block_drafter_proposes_through_its_cache_what_one_block_over_the_whole_context_computes():
    """DFlash: the context's states joined in two cycles through the head's cache (rows of different lengths), then
    the block [root, k masks] gives the logits of one block run alone over the whole context; only the context's
    real entries stay in the cache."""
    target = tiny_target("qwen3", num_layers=6)
    torch.manual_seed(4)
    head = DraftHead(head_config_for(target, "dflash", num_layers=2, options={"block_size": 5}), target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    k, lengths, first = 4, [9, 6], [5, 3]
    ids = torch.randint(4, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    features = target(ids, layer_ids=head.reads(target.num_layers)).features
    pos = torch.arange(10).expand(2, -1)
    cache = head.new_cache(2, 32)
    head.propose(ids[:, :5], features[:, :5], pos[:, :5], first, cache, k)
    rest = [n - f for n, f in zip(lengths, first)]
    take = torch.stack([torch.cat([torch.arange(f, n), torch.full((max(rest) - (n - f),), n - 1)])
                        for f, n in zip(first, lengths)])
    got = head.propose(ids.gather(1, take), features.gather(1, take[..., None].expand(-1, -1, features.shape[-1])),
                       pos.gather(1, take), rest, cache, k)
    assert cache.host_lengths == lengths and got.shape == (2, k, target.vocab_size)
    for b, n in enumerate(lengths):  # the root is the token at n - 1's state's next position: ids[b, n - 1] shifted
        block = head.block(ids[b, n - 1:n], k + 1)
        allowed = torch.ones(1, k + 1, n + k + 1, dtype=torch.bool)
        hidden = head(block, head.context(features[b:b + 1, :n]), n + torch.arange(k + 1)[None], pos[b:b + 1, :n],
                      allowed)
        torch.testing.assert_close(got[b], head.project(hidden)[0, 1:], rtol=1e-5, atol=1e-5)
