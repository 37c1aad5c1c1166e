"""A CPU Target moves its model's weights into one buffer in step order (`models/weight_arena.py`) without changing
what the model is or computes."""

import torch

from eyas.models import weight_arena
from eyas.models.target import Target
from tests.helpers.tiny import tiny_model, tiny_tokenizer


def test_weights_move_into_one_buffer_in_step_order_with_the_logits_last():
    model = tiny_model("llama", tied=True)
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    x = torch.randint(0, 320, (1, 7))
    want = model(x).logits
    Target(model, tiny_tokenizer(), "tiny-llama")

    params = list(model.parameters())  # tied weights once
    head = model.get_output_embeddings().weight
    order = [p for p in params if p is not head] + [head]
    starts = [p.data_ptr() for p in order]
    assert starts == sorted(starts), "the weights are not laid out in registration order with the lm_head last"
    # back to back: each weight starts within a cache line after the one before it ends
    assert all(0 <= b - (a.data_ptr() + a.nbytes) < 64 for a, b in zip(order, starts[1:]))
    for name, p in model.named_parameters():
        same, values = before[name]
        assert p is same and torch.equal(p, values)
    assert model.get_input_embeddings().weight is head  # still tied
    assert torch.equal(model(x).logits, want)
    assert weight_arena.arrange_weights(model, head) == 0, "a second Target moved the weights again"


def test_weights_that_view_a_larger_buffer_stay_and_cpu_kernels_off_moves_nothing():
    model = tiny_model("llama")
    layer = model.model.layers[0].mlp
    shared = torch.randn(2, *layer.up_proj.weight.shape)
    layer.up_proj.weight.data = shared[0]  # a view: moving it would keep `shared` alive, the bytes twice
    gate = layer.gate_proj.weight.data_ptr()
    as_loaded = Target(tiny_model("llama"), None, "tiny", cpu_kernels=False)
    ptrs = [p.data_ptr() for p in as_loaded.model.parameters()]

    Target(model, None, "tiny")
    assert layer.up_proj.weight.data_ptr() == shared[0].data_ptr()
    assert layer.gate_proj.weight.data_ptr() != gate
    assert [p.data_ptr() for p in as_loaded.model.parameters()] == ptrs, "cpu_kernels=False moved weights"
