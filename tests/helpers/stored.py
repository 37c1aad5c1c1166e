"""What a stored example promises about its target states: those of a forward of its tokens alone.

A state stored by regeneration or `cache_hidden` was computed in some batch, beside other rows, by kernels that
block the work by the batch's shape: it equals a forward of its tokens alone only up to rounding. Stored in bf16,
that is the rounding of fp32 states; which batch the example shared must not matter beyond it."""

from __future__ import annotations

import torch

# fp32 states of one example computed in different batches differ by rounding accumulated over the layers
# (~1e-6 relative on the tiny targets): this bounds it with room to spare.
FP32_NOISE = 1e-4


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of a state stored in `dtype` against the same state computed alone and cast to `dtype`:
    two fp32 values a rounding apart may round to neighbouring `dtype` values, one step (eps: bf16 2**-7) apart."""
    return torch.finfo(dtype).eps + FP32_NOISE


def assert_states_of_a_lone_forward(item: dict, target, layer_ids) -> None:
    """item (input_ids [T], hidden [T, H], features [T, F] when layer_ids): its states are those a forward of its
    own tokens alone computes, within its storage dtype's tolerance."""
    out = target(item["input_ids"][None], layer_ids=layer_ids, logits=False)
    assert ("features" in item) == bool(layer_ids)
    for key, alone in [("hidden", out.hidden)] + ([("features", out.features)] if layer_ids else []):
        stored = item[key]
        rtol = tolerance(stored.dtype)
        want = alone[0].to(stored.dtype)
        # near zero an element's error is the rounding of the whole state's magnitude, not of its own
        torch.testing.assert_close(stored.float(), want.float(), rtol=rtol, atol=rtol * float(want.abs().max()),
                                   msg=lambda m, key=key: f"{key}: {m}")
