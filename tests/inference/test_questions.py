"""The MT-bench questions ship with eyas: `--questions mt-bench` needs no file of the user's."""

from collections import Counter

from eyas.inference.bench import load_questions


def test_mt_bench_ships_with_every_category():
    questions = load_questions("mt-bench")
    assert len(questions) == 80 and all(q.chat and q.prompt for q in questions)
    assert set(Counter(q.category for q in questions).values()) == {10}  # 8 categories of 10
    assert [q.category for q in load_questions("mt-bench", per_category=1)] == sorted(
        {q.category for q in questions}, key=[q.category for q in questions].index)
