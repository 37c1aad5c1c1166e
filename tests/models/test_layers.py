"""The head's layers keep what must stay exact in fp32 whatever the head's dtype."""

import torch

from eyas.models.layers import Rotary


def test_a_bf16_heads_rope_phase_matches_fp32_at_long_positions():
    """RoPE frequencies stay fp32 when the head is cast to bf16 (they are not a buffer): at theta 5e5 and position
    2000 a bf16 inv_freq would put the phase off by radians; only the final cos/sin are rounded to bf16."""
    head_dim, theta = 128, 5e5
    rotary, reference = Rotary(head_dim, theta), Rotary(head_dim, theta)
    rotary.to(torch.bfloat16)  # what head.to(bf16) does to its modules
    positions = torch.tensor([[0, 1, 17, 2000, 8191]])
    cos, sin = rotary(positions, torch.bfloat16)
    ref_cos, ref_sin = reference(positions, torch.float32)
    assert rotary.inv_freq.dtype == torch.float32
    assert (cos.float() - ref_cos).abs().max() < 1e-2 and (sin.float() - ref_sin).abs().max() < 1e-2  # bf16 rounding
    rounded = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).to(torch.bfloat16)
    phase_error = (2000 * rounded.double() - 2000 * reference.inv_freq.double()).abs().max()
    assert phase_error > 1.0  # what keeping the frequencies in fp32 avoids
