"""What the machine running the tests can do, for tests that play another kind of CPU."""

import pytest
import torch


def skip_unless_runs_bf16_units(capabilities: dict) -> None:
    """Skip a test that plays a CPU with bf16 units (AVX512-BF16, AMX) where the CPU running it cannot run the
    prepacked bf16 products eyas takes on one: oneDNN multiplies bf16 only with AVX-512 or AVX-NE-CONVERT."""
    if (capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")) and \
            not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("plays a CPU with bf16 units, whose prepacked bf16 products this CPU cannot run (oneDNN needs "
                    "AVX-512 or AVX-NE-CONVERT for them)")
