"""What the machine running the tests can do, for tests that play another kind of CPU."""

import pytest
import torch

from eyas.models.cpu_kernels import native_bf16


def skip_unless_runs_bf16_units() -> None:
    """Skip a test playing a CPU with bf16 units (`native_bf16`, read after the capabilities are played) where the
    CPU running it cannot run the prepacked bf16 products eyas takes on one: oneDNN multiplies bf16 only with AVX-512
    or AVX-NE-CONVERT."""
    if native_bf16() is not None and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("plays a CPU with bf16 units, whose prepacked bf16 products this CPU cannot run (oneDNN needs "
                    "AVX-512 or AVX-NE-CONVERT for them)")
