import os

# Tiny models: one thread is fastest (thread hand-off costs more than the matmuls), and it keeps
# the suite steady when the machine is shared. Set before torch is imported by any test module.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
