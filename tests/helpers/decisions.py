"""Two regenerations compared conversation by conversation, where a drawn token may differ by rounding alone.

A token is a discrete decision taken from fp32 logits, and one conversation's logits differ by rounding between
batch groupings (other rows beside it, kernels blocking the work by the batch's shape). A draw that lands within
rounding of the boundary between two tokens then picks differently: rare, but deterministic on that machine, and
from there the two runs write different conversations, both right. `Draws` records what every draw saw;
`assert_same_regeneration` accepts such a parting only where it is rounding, and otherwise wants equality."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eyas.data.regenerate import Scheduler

# one conversation's logits computed in different batches: fp32 rounding accumulated over the layers (~1e-6
# relative on the tiny targets), bounded with room to spare
LOGITS_RTOL = 1e-4


class Draws:
    """Records every token regeneration draws: per conversation id, per (turn, step), the token drawn, the logits
    row [V] it was drawn from and the state of the conversation's generator before the draw (None: greedy).
    `start()` opens a new record that the regenerations run after it fill (a killed run and its rerun: one)."""

    def __init__(self, monkeypatch) -> None:
        self.current: dict[int, dict] = {}
        choose = Scheduler._choose

        def recording(scheduler, rows, logits):
            jobs = [scheduler.slots[r] for r in rows]
            before = [(j.turns_done, len(j.generated), None if j.generator is None else j.generator.get_state())
                      for j in jobs]
            choose(scheduler, rows, logits)
            for job, row, (turn, step, state) in zip(jobs, logits, before):
                if (turn, step) == (0, 0):  # (re)started: a rerun regenerates what a stop dropped, from scratch
                    self.current[job.id] = {}
                self.current[job.id][turn, step] = (job.generated[-1], row.clone(), state)

        monkeypatch.setattr(Scheduler, "_choose", recording)

    def start(self) -> dict[int, dict]:
        self.current = {}
        return self.current


def parted(first: dict[int, dict], second: dict[int, dict]) -> set[int]:
    """The conversations on which two runs' draws part. Each parting must be rounding: at the first token that
    differs, both runs drew with the same randomness (generator state) from logits equal up to fp32 rounding, so
    the same rule met the same distribution; after it the conversation's trajectories legitimately differ."""
    assert first.keys() == second.keys(), "the runs drew for different conversations"
    out = set()
    for cid, a in first.items():
        b = second[cid]
        for key in sorted(a.keys() | b.keys()):
            # the same tokens so far end turns and answers alike: both runs drew here
            assert key in a and key in b, f"conversation {cid}: only one run drew at (turn, step) {key}"
            (token_a, logits_a, state_a), (token_b, logits_b, state_b) = a[key], b[key]
            if token_a == token_b:
                continue
            assert (state_a is None) == (state_b is None) and (state_a is None or torch.equal(state_a, state_b)), \
                f"conversation {cid} at {key}: drawn with different randomness"
            torch.testing.assert_close(logits_a, logits_b, rtol=LOGITS_RTOL,
                                       atol=LOGITS_RTOL * float(logits_a.abs().max()),
                                       msg=lambda m, cid=cid, key=key: f"conversation {cid} at {key}: {m}")
            out.add(cid)
            break
    return out


def assert_same_regeneration(first_draws: dict, second_draws: dict, first: dict[int, object],
                             second: dict[int, object]) -> set[int]:
    """Two runs stored the same conversations (`first`, `second`: {id: what each stored for it}, equal ids), each
    exactly the same unless the runs parted on it by rounding (`parted`); returns the ids they parted on. Where
    no draw parts, the normal case, this is plain equality."""
    assert sorted(first) == sorted(second), "the runs stored different conversations"
    split = parted(first_draws, second_draws)
    for cid in first.keys() - split:
        assert first[cid] == second[cid], f"conversation {cid} differs though every draw was the same"
    return split


def lines_by_id(path: Path) -> dict[int, str]:
    """{conversation id: its line} of a regeneration's JSONL; no id written twice."""
    lines = path.read_text().splitlines()
    by_id = {json.loads(line)["id"]: line for line in lines}
    assert len(by_id) == len(lines), "an id written twice"
    return by_id
