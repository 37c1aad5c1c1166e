import json
from types import SimpleNamespace

import pytest
import torch

from eyas.inference import bench
from eyas.inference.bench import Question, load_questions, run_bench
from eyas.inference.bench_report import accept_rate_per_position
from tiny import tiny_target

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["hello world w1 w2", "ignored second turn"]},
    {"question_id": 2, "category": "writing", "turns": ["the w5 w6 w7 ."]},
    {"question_id": "HumanEval/0", "category": "code", "prompt": "a w10 w11 w12 w13"},
]


class _StandInGenerator:
    """Greedy decoding with the target alone, reporting made-up cycles; stands in until inference lands."""

    def __init__(self, target):
        self.target = target

    def generate(self, ids, max_new_tokens, temperature, top_p, top_k, eos_token_id, seed):
        out = self.target.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                         eos_token_id=eos_token_id, pad_token_id=1)
        tokens = out[0, len(ids):].tolist()
        accepted = [1 + i % 3 for i in range(len(tokens) // 2)]
        stats = SimpleNamespace(accepted=accepted, draft_time_s=0.01, target_time_s=0.02, total_time_s=0.04,
                                prefill_time_s=0.005)
        return SimpleNamespace(tokens=tokens, stats=stats)


@pytest.fixture
def target(monkeypatch):
    t = tiny_target("llama")
    monkeypatch.setattr(bench, "load_generator",
                        lambda target, head, dtype, opts: (t, _StandInGenerator(t), SimpleNamespace(depth=3)))
    return t


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_report_has_every_field_per_category_and_overall(tmp_path, target):
    report = run_bench(target, "head", _write(tmp_path / "q.jsonl", QUESTIONS), max_new_tokens=12,
                       prompt_lookup=3, out=tmp_path / "report.json", progress=False)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert (tmp_path / "report.png").stat().st_size > 0
    assert set(saved["per_category"]) == {"writing", "code"}
    for s in [saved["overall"], *saved["per_category"].values()]:
        assert s["tau"] >= 1.0
        assert all(r is None or 0.0 <= r <= 1.0 for r in s["accept_rate_per_position"])
        assert len(s["accept_rate_per_position"]) >= 3
        for key in ("baseline_tokens_per_s", "spec_tokens_per_s", "speedup", "prompt_lookup_tokens_per_s",
                    "prompt_lookup_speedup"):
            assert s[key] > 0, key
        for key in ("draft_time_fraction", "engine_overhead_fraction"):
            assert 0.0 <= s[key] <= 1.0, key
        assert s["exact_match_fraction"] == 1.0
    assert saved["overall"]["questions"] == 3 and saved["per_category"]["writing"]["questions"] == 2
    st = saved["settings"]
    assert st["dtype"] == "fp32" and st["threads"] >= 1 and st["max_new_tokens"] == 12
    assert st["versions"]["torch"] and st["machine"]["cores"] >= 1
    rows = saved["questions"]
    assert [r["question_id"] for r in rows] == [1, 2, "HumanEval/0"]
    assert all(r["exact"] and r["spec_tokens"] == r["baseline_tokens"] > 0 for r in rows)


def test_chat_rows_use_the_template_and_prompt_rows_do_not(target):
    chat = bench.prompt_ids(target, Question(1, "c", "hello world", chat=True))
    raw = bench.prompt_ids(target, Question(2, "c", "hello world", chat=False))
    tok = target.tokenizer
    assert raw == tok("hello world")["input_ids"]
    assert tok.convert_ids_to_tokens(chat[:2]) == ["<|im_start|>", "user"]
    assert tok.convert_ids_to_tokens(chat[-2:]) == ["<|im_start|>", "assistant"]  # add_generation_prompt
    assert chat[2:4] == raw


@pytest.mark.parametrize("line,message", [
    ("{not json", "q.jsonl:2: not valid JSON"),
    ('{"question_id": 3, "category": "x"}', "q.jsonl:2: a question needs `turns`"),
    ('{"question_id": 3, "category": "x", "turns": []}', "q.jsonl:2: `turns` must be"),
    ('[1, 2]', "q.jsonl:2: expected a JSON object"),
])
def test_malformed_rows_name_the_line(tmp_path, line, message):
    path = _write(tmp_path / "q.jsonl", [QUESTIONS[0], line])
    with pytest.raises(ValueError, match=message):
        load_questions(path)


def test_missing_or_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_questions(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no questions"):
        load_questions(_write(tmp_path / "q.jsonl", [""]))
    assert len(load_questions(_write(tmp_path / "q.jsonl", QUESTIONS), limit=2)) == 2


def test_accept_rate_per_position_is_conditional_on_reaching_the_position():
    # drafts accepted per cycle: 0, 1, 2, 3, 1
    assert accept_rate_per_position([1, 2, 3, 4, 2], 5) == [4 / 5, 2 / 4, 1 / 2, 0 / 1, None]


def test_cli_writes_report_and_prints_table(tmp_path, target, capsys):
    from eyas.inference.cli import main

    q = _write(tmp_path / "q.jsonl", QUESTIONS)
    rc = main(["bench", "--target", "tiny", "--head", "h", "--questions", str(q), "--out", str(tmp_path / "r.json"),
               "--max-new-tokens", "6", "--limit", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads((tmp_path / "r.json").read_text())["overall"]["questions"] == 2
    assert "overall" in out and "writing" in out and str(tmp_path / "r.png") in out


def test_cli_bad_questions_is_one_clear_line(tmp_path, target, capsys):
    from eyas.inference.cli import main

    q = _write(tmp_path / "q.jsonl", [QUESTIONS[0], '{"question_id": 9}'])
    rc = main(["bench", "--target", "tiny", "--head", "h", "--questions", str(q), "--out", str(tmp_path / "r.json")])
    assert rc == 2
    assert "q.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_demo_without_questions_says_where_to_get_them(capsys):
    from eyas.inference.cli import main

    assert main(["demo"]) == 2
    assert "mt_bench/question.jsonl" in capsys.readouterr().err
