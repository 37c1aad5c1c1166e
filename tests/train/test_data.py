"""The training data order: a step's examples depend only on the stream position (any world size, any resume),
grouping by length sorts within a step, and the DataLoader yields what the sampler says."""

import datasets
import torch

from eyas.train.data import ExampleStream, StepSampler, lengths_of, train_batches


def _dataset(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 50, (n,), generator=g).tolist()
    return datasets.Dataset.from_dict({"input_ids": [[i % 7 + 4] * k for i, k in enumerate(lengths)],
                                       "loss_mask": [[1] * k for k in lengths]}), lengths


def _steps(stream, lengths, size, world, accum, steps, consumed=0):
    """[step][rank] -> the example indices of each of that rank's micro-batches."""
    iters = [iter(StepSampler(stream, consumed, size, world, r, accum, lengths)) for r in range(world)]
    return [[[next(it) for _ in range(accum)] for it in iters] for _ in range(steps)]


def test_a_steps_examples_do_not_depend_on_world_size_and_resume_continues():
    ds, lengths = _dataset()
    stream = ExampleStream(ds, seed=3)
    one = _steps(stream, lengths, size=8, world=1, accum=1, steps=9)  # 9 * 8 > 40: crosses an epoch
    two = _steps(stream, lengths, size=2, world=2, accum=2, steps=9)
    for a, b in zip(one, two):
        assert sorted(a[0][0]) == sorted(x for rank in b for micro in rank for x in micro)
    resumed = _steps(stream, lengths, size=2, world=2, accum=2, steps=4, consumed=5 * 8)
    assert resumed == two[5:]
    plain = _steps(stream, None, size=8, world=1, accum=1, steps=2)
    assert plain[0][0][0] == [stream.index(p) for p in range(8)]  # ungrouped: stream order


def test_grouping_by_length_sorts_a_steps_examples_across_micro_batches_and_ranks():
    ds, lengths = _dataset()
    stream = ExampleStream(ds, seed=1)

    def padding(steps):
        return sum(len(s) * max(lengths[i] for i in s) - sum(lengths[i] for i in s)
                   for step in steps for rank in step for s in rank)

    grouped = _steps(stream, lengths, size=2, world=2, accum=2, steps=5)
    for step in grouped:
        slots = [step[r][m] for m in range(2) for r in range(2)]  # slot m * world + r
        flat = [lengths[i] for slot in slots for i in slot]
        assert flat == sorted(flat)
    assert padding(grouped) < padding(_steps(stream, None, size=2, world=2, accum=2, steps=5))


def test_loader_collates_the_samplers_batches_and_reads_lengths_without_token_lists():
    ds, lengths = _dataset()
    assert lengths_of(ds.select([5, 2, 9])) == [lengths[5], lengths[2], lengths[9]]
    stream = ExampleStream(ds, seed=0)
    sampler = StepSampler(stream, 0, 4, 1, 0, 1, lengths)
    batches = train_batches(ds, sampler, pad_id=0, workers=1, pin_memory=False)
    for expected, batch in zip(iter(sampler), (next(batches) for _ in range(3))):
        assert batch["attention_mask"].sum(1).tolist() == [lengths[i] for i in expected]
        assert batch["input_ids"][:, 0].tolist() == [i % 7 + 4 for i in expected]
