import os

# Tiny models: one thread is fastest (thread hand-off costs more than the matmuls), and it keeps
# the suite steady when the machine is shared. Set before torch is imported by any test module.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture
def calibrations(monkeypatch):
    """The planner's calibration runs as it does (the cost models it measured are collected: once per generator),
    then plans with fixed costs under which trees pay: what a test's generations verify then rests on the head's
    confidence, not on how loaded this machine is (measured costs may make every cycle plain decoding)."""
    import eyas.inference.generator as generator
    from eyas.inference.costs import CostModel

    measure, calls = generator.calibrate, []

    def calibrate(*args, **kwargs):
        calls.append(measure(*args, **kwargs))
        return CostModel(1.0, 0.01, 1.0, 0.001, learn=False)

    monkeypatch.setattr(generator, "calibrate", calibrate)
    return calls
