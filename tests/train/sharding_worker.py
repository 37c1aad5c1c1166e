"""One rank of tests/train/test_target_sharding.py (run under torch.distributed.run, gloo): loads a target folder
sharded as the trainer does (FSDP2), compares it with an unsharded copy and reports which weights are held whole after
repeated embedding and lm_head calls. Writes its JSON report to OUT/rank-R.json (stdout interleaves ranks)."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(folder: str, report_dir: str) -> None:
    from eyas.models import Target
    from eyas.models.loading import load_model_and_tokenizer
    from eyas.train import target_sharding as ts

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, tok, name = load_model_and_tokenizer(folder, torch.float32, distributed=ts.fsdp_config(folder, world, world))
    target = Target(model, tok, name)
    held, total = ts.held_parameters(target)
    reference = Target.load(folder, dtype="fp32", device="cpu")
    ids = torch.arange(4, 40).view(2, 18)
    out, ref = target(ids, layer_ids=[1, 2, 4]), reference(ids, layer_ids=[1, 2, 4])
    hidden = torch.randn(5, target.hidden_size, generator=torch.Generator().manual_seed(0))
    diffs = [float((out.features - ref.features).abs().max()), float((out.logits - ref.logits).abs().max()),
             float((target.logits(hidden) - reference.logits(hidden)).abs().max())]
    for _ in range(3):  # head steps: embedding lookups and logits of a few rows, with grad enabled as in training
        with torch.enable_grad():
            target.embed_tokens(ids)
        target.logits(hidden)
    layer_weight = target._layers[0].mlp.up_proj.weight
    whole = [_whole(p) for p in (target.embed_tokens.weight, target.lm_head.weight)]
    report = {"rank": dist.get_rank(), "held": held, "total": total, "diffs": diffs,
              "embedding_and_lm_head_whole": whole, "layer_whole": _whole(layer_weight)}
    with open(os.path.join(report_dir, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    os._exit(0)  # gloo can abort at interpreter exit


def _whole(p: torch.Tensor) -> bool:
    """Is this weight held whole right now (gathered and kept), not only this rank's shard? FSDP2 swaps in the
    unsharded parameter while it is gathered."""
    from torch.distributed.tensor import DTensor

    return not isinstance(p, DTensor)


if __name__ == "__main__":
    main(*sys.argv[1:])
