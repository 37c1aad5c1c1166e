import json
import os

import pytest
import torch

from eyas.inference import bench
from eyas.inference.bench import Question, load_questions, run_bench
from eyas.inference.bench_report import accept_rate_per_position, format_table, summarize
from eyas.inference.runtimes_vllm import ENGINES
from eyas.models import DraftHead, save_head
from eyas.models.head_config import head_config_for
from eyas.models.sampling import Sampling
from tests.helpers.plots import assert_plotted
from tests.helpers.tiny import tiny_target
from tests.helpers.train import write_target

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["hello world w1 w2", "ignored second turn"]},
    {"question_id": 2, "category": "writing", "turns": ["the w5 w6 w7 ."]},
    {"question_id": "HumanEval/0", "category": "code", "prompt": "a w10 w11 w12 w13"},
]
QUESTIONS_AS_OBJECTS = [Question(1, "writing", "hello world w1 w2", chat=True),
                        Question("HumanEval/0", "code", "a w10 w11 w12 w13", chat=False)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from more threads, and on a shared CPU spinning threads cost ~10x.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair():
    """Tiny fp32 target and a random EAGLE-3 head: few drafts accepted, but every verify path runs."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    return target, DraftHead(head_config_for(target, "eagle3"), target)


@pytest.fixture
def saved_pair(tmp_path, pair):
    target_dir = write_target(tmp_path / "target")
    save_head(pair[1], tmp_path / "head")
    return target_dir, tmp_path / "head"


SMALL_TREE = dict(depth=3, top_k=2, total_tokens=6)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_report_has_every_field_per_category_and_overall(tmp_path, pair):
    report = run_bench(*pair, _write(tmp_path / "q.jsonl", QUESTIONS), max_new_tokens=12, prompt_lookup=3,
                       eyas_plain=True, out=tmp_path / "report.json", progress=False, **SMALL_TREE)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert_plotted(tmp_path / "report.png")
    assert set(saved["per_category"]) == {"writing", "code"}
    for row in saved["questions"]:  # every token came from a cycle (the last one's may pass max_new_tokens)
        a = row["accepted"]
        # the prefill decides the first token, every cycle at least one more
        assert min(a) >= 1 and 1 + sum(a[:-1]) < row["spec_tokens"] <= 1 + sum(a)
    cycles = sum(len(r["accepted"]) for r in saved["questions"])
    assert saved["overall"]["tau"] == pytest.approx(sum(sum(r["accepted"]) for r in saved["questions"]) / cycles)
    for s in [saved["overall"], *saved["per_category"].values()]:
        assert all(r is None or 0.0 <= r <= 1.0 for r in s["accept_rate_per_position"])
        assert len(s["accept_rate_per_position"]) >= SMALL_TREE["depth"]
        for key in ("baseline_tokens_per_s", "spec_tokens_per_s", "speedup", "prompt_lookup_tokens_per_s",
                    "prompt_lookup_speedup", "eyas_plain_tokens_per_s", "eyas_plain_speedup",
                    "speedup_over_eyas_plain"):
            assert s[key] > 0, key
        for key in ("draft_time_fraction", "engine_overhead_fraction"):
            assert 0.0 <= s[key] <= 1.0, key
        assert s["exact_match_fraction"] == 1.0
    assert saved["overall"]["questions"] == 3 and saved["per_category"]["writing"]["questions"] == 2
    st = saved["settings"]
    assert st["dtype"] == "fp32" and st["threads"] >= 1 and st["max_new_tokens"] == 12
    assert st["tree"]["depth"] == 3 and st["tree"]["total_tokens"] == 6
    assert st["versions"]["torch"] and st["machine"]["cores"] >= 1
    rows = saved["questions"]
    assert [r["question_id"] for r in rows] == [1, 2, "HumanEval/0"]
    assert all(r["exact"] and r["spec_tokens"] == r["baseline_tokens"] > 0 for r in rows)
    assert all(r["eyas_plain_exact"] and r["eyas_plain_tokens"] == r["baseline_tokens"] for r in rows)
    memory = saved["memory_limit"]  # plain decoding's bound, measured in the run
    untied = {n: p for n, p in pair[0].model.named_parameters() if "embed_tokens" not in n}
    assert memory["bytes"] == sum(p.nbytes for p in untied.values())
    assert memory["tokens_per_s"] == pytest.approx(memory["bandwidth"] / memory["bytes"])
    # read before the questions and after each of the 3
    assert memory["samples"] == 4 and memory["low"] <= memory["bandwidth"] <= memory["high"]
    assert "memory limit of plain decoding" in format_table(saved)


def test_out_of_draft_vocab_counts_the_output_tokens_the_head_cannot_propose(tmp_path, pair):
    target = pair[0]
    head = DraftHead(head_config_for(target, "eagle3", draft_vocab_size=target.vocab_size // 2), target)
    order = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))
    head.set_vocab_map(order[: target.vocab_size // 2])
    report = run_bench(target, head, QUESTIONS_AS_OBJECTS, max_new_tokens=16, progress=False, **SMALL_TREE)
    outside = total = 0
    for q, row in zip(QUESTIONS_AS_OBJECTS, report["questions"]):
        # the same greedy output, decoded without the head: which of its tokens the draft vocab lacks
        tokens = bench.plain_decode(target, bench.prompt_ids(target, q), 16, target.eos_ids(), Sampling(), 0)
        expected = sum(not bool(head.t2d[t]) for t in tokens)
        assert row["out_of_draft_vocab_tokens"] == expected
        outside, total = outside + expected, total + len(tokens)
    assert 0 < outside < total  # the check above saw both kinds of token
    assert report["overall"]["out_of_draft_vocab_fraction"] == pytest.approx(outside / total)


def test_chat_rows_use_the_template_and_prompt_rows_do_not(pair):
    target = pair[0]
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
    one_each = load_questions(tmp_path / "q.jsonl", per_category=1)
    assert [(q.question_id, q.category) for q in one_each] == [(1, "writing"), ("HumanEval/0", "code")]


def test_accept_rate_per_position_is_conditional_on_reaching_the_position():
    # drafts accepted per cycle: 0, 1, 2, 3, 1
    assert accept_rate_per_position([1, 2, 3, 4, 2], 5) == [4 / 5, 2 / 4, 1 / 2, 0 / 1, None]
    # plain cycles (depth 0) and positions a cycle did not draft do not count
    assert accept_rate_per_position([1, 2, 1, 3, 2], 3, [0, 1, 0, 3, 3]) == [3 / 3, 1 / 2, 0 / 1]


def test_cli_writes_report_and_prints_table(tmp_path, saved_pair, capsys):
    from eyas.inference.cli import main

    q = _write(tmp_path / "q.jsonl", QUESTIONS)
    rc = main(["bench", "--target", str(saved_pair[0]), "--head", str(saved_pair[1]), "--questions", str(q),
               "--out", str(tmp_path / "r.json"), "--max-new-tokens", "6", "--limit", "2", "--tree", "chain",
               "--depth", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["overall"]["questions"] == 2 and report["overall"]["exact_match_fraction"] == 1.0
    assert report["settings"]["tree"]["kind"] == "chain"
    assert "overall" in out and "writing" in out and str(tmp_path / "r.png") in out
    assert_plotted(tmp_path / "r.png")


def test_cli_repeats_against_eyas_plain_without_generate(tmp_path, saved_pair, capsys):
    from eyas.inference.cli import main

    q = _write(tmp_path / "q.jsonl", QUESTIONS)
    args = ["bench", "--target", str(saved_pair[0]), "--head", str(saved_pair[1]), "--questions", str(q),
            "--out", str(tmp_path / "r.json"), "--max-new-tokens", "4", "--limit", "1", "--repeats", "2"]
    assert main(args + ["--no-generate"]) == 2  # no reference to compare with
    assert "--eyas-plain" in capsys.readouterr().err
    assert main(args + ["--no-generate", "--eyas-plain"]) == 0
    row = json.loads((tmp_path / "r.json").read_text())["questions"][0]
    assert len(row["spec_times_s"]) == len(row["eyas_plain_times_s"]) == 2 and "baseline_time_s" not in row
    assert "median of 2 alternated repeats" in capsys.readouterr().out


def test_ctrl_c_ends_after_the_question_in_hand_and_reports_the_questions_done(tmp_path, pair, monkeypatch):
    import os
    import signal

    from eyas.inference.generator import SpeculativeGenerator

    generate, calls = SpeculativeGenerator.generate, []

    def ctrl_c_in_the_first_question(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the warm-up, then the first question
            os.kill(os.getpid(), signal.SIGINT)
        return generate(self, *a, **kw)

    monkeypatch.setattr(SpeculativeGenerator, "generate", ctrl_c_in_the_first_question)
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    report = run_bench(*pair, QUESTIONS_AS_OBJECTS, max_new_tokens=4, out=tmp_path / "r.json", progress=False,
                       **SMALL_TREE)
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert report["overall"]["questions"] == 1 and len(report["questions"]) == 1  # the question in hand finished
    assert report["settings"]["stopped"] == {"signal": signal.SIGINT, "questions_done": 1, "questions_left": 1}
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["stopped"]["questions_done"] == 1


def test_cli_bad_questions_is_one_clear_line(tmp_path, capsys):
    from eyas.inference.cli import main

    q = _write(tmp_path / "q.jsonl", [QUESTIONS[0], '{"question_id": 9}'])
    rc = main(["bench", "--target", "unused", "--head", "unused", "--questions", str(q),
               "--out", str(tmp_path / "r.json")])
    assert rc == 2
    assert "q.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_demo_distils_trains_exports_and_benches(tmp_path, capsys):
    from eyas.inference.cli import main
    from tests.helpers.train import TINY_CONFIG, write_conversations

    target, data = write_target(tmp_path / "target"), write_conversations(tmp_path / "convs.jsonl")
    rc = main(["demo", "--config", str(TINY_CONFIG), "--questions", str(_write(tmp_path / "q.jsonl", QUESTIONS)),
               "--head-out", str(tmp_path / "head"), "--dtype", "fp32", "--limit", "2", "--max-new-tokens", "8",
               "--distill-source", str(data), "--distill-conversations", "12", "--distill-max-new-tokens", "8",
               f"target.spec={target}", f"output_dir={tmp_path / 'run'}", "head.draft_vocab_size=64",
               "schedule.total_steps=2", "checkpoint.every=2"])
    out = capsys.readouterr().out
    assert rc == 0
    regenerated = (tmp_path / "run" / "selfdistill.jsonl").read_text().splitlines()
    assert 0 < len(regenerated) <= 12 and (tmp_path / "run" / "hidden" / "index.json").is_file()
    assert "data.hidden_states=offline" in out  # the head trained on the states captured while regenerating
    report = json.loads((tmp_path / "run" / "bench" / "report.json").read_text())
    assert report["overall"]["questions"] == 2 and report["overall"]["exact_match_fraction"] == 1.0
    assert "prompt_lookup_speedup" in report["overall"]
    assert (tmp_path / "head" / "config.json").is_file()
    assert_plotted(tmp_path / "run" / "bench" / "report.png")
    assert f"head:   {tmp_path / 'head'}" in out and "$ eyas export" in out


def _rows(*lengths_and_times):
    return [{"category": "c", "accepted": [2, 1], "baseline_tokens": bt, "baseline_time_s": bs, "spec_tokens": st,
             "spec_time_s": ss, "engine_time_s": ss, "draft_time_s": 0.1 * ss, "target_time_s": 0.8 * ss,
             "exact": bt == st} for bt, bs, st, ss in lengths_and_times]


def test_speedup_is_a_time_ratio_for_equal_outputs_else_a_tokens_per_s_ratio():
    same = summarize(_rows((10, 2.0, 10, 1.0), (6, 1.0, 6, 1.0)), sampling=False)["overall"]
    assert same["speedup_basis"] == "time" and same["speedup"] == pytest.approx(3.0 / 2.0)
    assert same["engine_overhead_fraction"] == pytest.approx(0.1)
    differ = summarize(_rows((10, 2.0, 20, 2.0)), sampling=True)["overall"]
    assert differ["speedup_basis"] == "tokens_per_s" and differ["speedup"] == pytest.approx(2.0)
    assert differ["exact_match_fraction"] is None


def test_sampling_runs_both_sides_with_the_same_settings(tmp_path, pair):
    report = run_bench(*pair, QUESTIONS_AS_OBJECTS[:2], max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=20,
                       progress=False, kind="chain", depth=2)
    assert report["overall"]["exact_match_fraction"] is None
    assert report["settings"]["temperature"] == 0.8 and report["settings"]["top_k"] == 20
    assert all(0 < r["spec_tokens"] <= 6 and 0 < r["baseline_tokens"] <= 6 for r in report["questions"])


def test_repeats_alternate_and_the_report_resummarises_from_its_rows(tmp_path, pair):
    report = run_bench(*pair, QUESTIONS_AS_OBJECTS, max_new_tokens=8, eyas_plain=True, generate=False, repeats=3,
                       out=tmp_path / "r.json", progress=False, **SMALL_TREE)
    for row in report["questions"]:
        assert "baseline_time_s" not in row and row["exact"] and row["eyas_plain_exact"]
        for name in ("spec", "eyas_plain"):
            times = row[f"{name}_times_s"]
            assert len(times) == 3 and row[f"{name}_time_s"] == sorted(times)[1]  # the median of three
    saved = json.loads((tmp_path / "r.json").read_text())
    again = summarize(saved["questions"], sampling=False, depth=SMALL_TREE["depth"])
    assert again["overall"] == saved["overall"] and again["per_category"] == saved["per_category"]
    o = saved["overall"]
    assert o["question_speedup_reference"] == "eyas_plain" and "speedup" not in o
    assert o["worst_run_speedup"] <= o["worst_question_speedup"] <= o["p10_question_speedup"]
    table = format_table(saved)
    assert "worst" in table and "median of 3 alternated repeats" in table
    assert_plotted(tmp_path / "r.png")


def test_question_speedups_give_the_worst_question_the_tenth_percentile_and_the_share_slower():
    rows = [{"question_id": i, "category": "c" if i < 5 else "d", "accepted": [1], "spec_tokens": 10,
             "spec_time_s": 1.0, "spec_times_s": [1.0, 1.0, 1.0], "eyas_plain_tokens": 10,
             "eyas_plain_time_s": t, "eyas_plain_times_s": [t, t, 0.5 if i == 3 else t], "engine_time_s": 1.0,
             "draft_time_s": 0.1, "target_time_s": 0.8, "exact": True}
            for i, t in enumerate([0.9, 1.2, 1.5, 1.1, 2.0, 0.96, 1.3, 1.4, 1.6, 1.7])]
    report = summarize(rows, sampling=False)
    o = report["overall"]
    assert o["worst_question"] == 0 and o["worst_question_speedup"] == pytest.approx(0.9)
    assert o["p10_question_speedup"] == pytest.approx(0.9 + 0.9 * (0.96 - 0.9))  # between the lowest two
    assert o["slower_question_fraction"] == pytest.approx(0.2)
    assert o["worst_run_speedup"] == pytest.approx(0.5)  # question 3's third run, not its median
    # the noise: question 3's plain decoding against itself; category d's repeats agree
    assert o["reference_vs_itself_worst_run"] == pytest.approx(0.5 / 1.1)
    assert report["per_category"]["d"]["reference_vs_itself_worst_run"] == pytest.approx(1.0)
    assert report["per_category"]["d"]["worst_question"] == 5
    assert report["per_category"]["c"]["slower_question_fraction"] == pytest.approx(0.2)


def test_eyas_chain_verifies_k_drafts_every_step_beside_the_planned_trees(tmp_path, pair):
    report = run_bench(*pair, QUESTIONS_AS_OBJECTS, max_new_tokens=10, eyas_chain=2, eyas_plain=True, repeats=2,
                       out=tmp_path / "r.json", progress=False, **SMALL_TREE)
    for row in report["questions"]:
        c = row["eyas_chain_counters"]
        assert row["eyas_chain_exact"] and row["eyas_chain_draft_tokens"] == 2
        assert c["drafts"] == c["steps"] == len(row["eyas_chain_accepted"]) and c["draft_tokens"] == 2 * c["steps"]
        assert all(1 <= a <= 3 for a in row["eyas_chain_accepted"])
        assert c["accepted_per_position"] == [sum(a > k + 1 for a in row["eyas_chain_accepted"]) for k in range(2)]
    chain = report["overall"]["runtimes"]["eyas_chain"]
    accepted = [a for r in report["questions"] for a in r["eyas_chain_accepted"]]
    assert chain["label"] == "eyas chain-2" and chain["tau"] == pytest.approx(sum(accepted) / len(accepted))
    assert chain["accept_rate_per_position"] == accept_rate_per_position(accepted, 2)
    assert chain["exact_match_fraction"] == 1.0 and chain["aa_worst_run"] <= 1.0
    assert "eyas chain-2" in format_table(report) and report["settings"]["eyas_chain"] == 2
    assert_plotted(tmp_path / "r.png")


def _timed(name, times, tokens=10):
    return {f"{name}_tokens": tokens, f"{name}_time_s": sorted(times)[(len(times) - 1) // 2], f"{name}_times_s": times}


def test_a_ratio_counts_only_beyond_both_runtimes_a_a_spread():
    from eyas.inference.bench_report import compare

    rows = [{**_timed("baseline", [2.0, 2.2]), **_timed("spec", [1.0, 1.05]), **_timed("eyas_plain", [1.9, 2.0])}]
    assert compare(rows, "baseline", "spec") == (pytest.approx(2.0), False)  # 2x: far beyond a 10% spread
    ratio, within = compare(rows, "baseline", "eyas_plain")
    assert ratio == pytest.approx(2.0 / 1.9) and within  # 5% faster, inside generate's own 10%
    one = [{**_timed("baseline", [2.0]), **_timed("spec", [1.0])}]
    assert compare(one, "baseline", "spec") == (pytest.approx(2.0), None)  # no repeats: nothing to judge by
    # another program slows one repeat of one question 20x: its median drops it, and the spread that judges is the
    # typical question's, while the worst question's is kept beside it
    hiccup = [{**_timed("baseline", [2.0, 40.0] if q == 1 else [2.0, 2.1]), **_timed("spec", [1.6, 1.65])}
              for q in range(3)]
    assert compare(hiccup, "baseline", "spec") == (pytest.approx(2.0 / 1.6), False)
    report = summarize([{**r, "category": "c", "accepted": [1], "engine_time_s": 1.0, "draft_time_s": 0.1,
                         "target_time_s": 0.8, "exact": True} for r in hiccup], sampling=False)
    generate = report["overall"]["runtimes"]["baseline"]
    assert generate["aa_spread"] == pytest.approx(2.0 / 2.1) and generate["aa_worst_run"] == pytest.approx(0.05)


def test_runtime_table_says_within_noise_which_ran_and_where_chain_and_engine_first_disagree():
    base = {"category": "c", "accepted": [2, 1], "engine_time_s": 1.0, "draft_time_s": 0.1, "target_time_s": 0.8,
            "exact": True, "eyas_chain_draft_tokens": 2, "vllm_draft_tokens": 2, "vllm_ordered": True,
            **_timed("baseline", [2.0, 2.2]), **_timed("spec", [1.0, 1.05]), **_timed("eyas_plain", [1.9, 2.0]),
            **_timed("eyas_chain", [1.2, 1.25]), **_timed("vllm", [0.9, 0.95])}

    def counters(accepted):
        return {"steps": len(accepted), "drafts": len(accepted), "draft_tokens": 2 * len(accepted),
                "accepted_tokens": sum(a - 1 for a in accepted),
                "accepted_per_position": [sum(a > k + 1 for a in accepted) for k in range(2)]}

    rows = [{**base, "question_id": q, "eyas_chain_accepted": mine, "vllm_accepted": theirs,
             "eyas_chain_counters": counters(mine), "vllm_counters": counters(theirs)}
            for q, mine, theirs in [(7, [3, 1, 2], [3, 1, 1]), (8, [2, 3, 1, 2], [2, 3, 2, 2])]]
    report = {"settings": {"repeats": 2, "engines": {"not_run": {"SGLang": "why, in one line"}}},
              **summarize(rows, sampling=False)}
    # question 7's last step may be cut by the token cap: the first disagreement compared is question 8's step 2
    assert report["overall"]["chain_vs_engine"] == {"engine": "vllm", "steps_agreed": 4, "first": {
        "question": 8, "step": 2, "token": 6, "eyas_chain": 1, "vllm": 2}}
    rt = report["overall"]["runtimes"]
    assert rt["vllm"]["tau"] == rt["eyas_chain"]["tau"] == pytest.approx(14 / 7)  # tokens over steps, each
    table = format_table(report)
    assert "ran: generate, eyas, eyas chain-2, eyas plain, vLLM + head" in table
    assert "not run: SGLang: why, in one line" in table
    eyas_plain_line = next(line for line in table.splitlines() if line.startswith("eyas plain"))
    assert "within noise" in eyas_plain_line
    assert ("eyas chain-2 and vLLM + head first disagree at question 8, step 2 (output token 6): eyas chain-2 gained "
            "1, vLLM + head 2 (after 4 steps that agreed)") in table


def test_cli_sglang_where_it_is_not_installed_runs_the_rest_and_says_why(tmp_path, saved_pair, capsys, monkeypatch):
    from eyas.inference.cli import main

    monkeypatch.delenv("EYAS_SGLANG_PYTHON", raising=False)
    q = _write(tmp_path / "q.jsonl", QUESTIONS)
    assert main(["bench", "--target", str(saved_pair[0]), "--head", str(saved_pair[1]), "--questions", str(q),
                 "--out", str(tmp_path / "r.json"), "--max-new-tokens", "4", "--limit", "1", "--sglang"]) == 0
    out = capsys.readouterr().out
    assert f"not run: SGLang: {ENGINES['sglang'].missing}" in out and "ran: generate, eyas\n" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["settings"]["runtimes"] == ["baseline", "spec"]  # no engine ran, so no chain to compare with


SGLANG = os.environ.get("EYAS_SGLANG_PYTHON")


@pytest.mark.skipif(not SGLANG, reason=f"SGLang is not installed: {ENGINES['sglang'].missing}")
def test_sglang_runs_beside_eyas_with_its_own_counters(tmp_path, capsys):
    """SGLang plain and with the head (exported in the sglang layout), alternated with eyas: greedy outputs equal
    generate's, its counters give tau, and eyas chain-3 runs beside it."""
    from eyas.inference.cli import main
    from tests.inference.test_vllm import varied_head, vllm_target

    target = vllm_target(tmp_path / "target")
    save_head(varied_head(target, 100, fused_layer_ids=(2, 4, 6)), tmp_path / "head")
    q = _write(tmp_path / "q.jsonl", QUESTIONS)
    assert main(["bench", "--target", str(tmp_path / "target"), "--head", str(tmp_path / "head"), "--questions",
                 str(q), "--out", str(tmp_path / "r.json"), "--max-new-tokens", "16", "--dtype", "fp32", "--sglang",
                 "--draft-tokens", "3", "--eager"]) == 0
    rt = json.loads((tmp_path / "r.json").read_text())["overall"]["runtimes"]
    assert {"sglang", "sglang_plain", "eyas_chain"} <= set(rt)
    assert rt["sglang"]["exact_match_fraction"] == rt["sglang_plain"]["exact_match_fraction"] == 1.0
    assert rt["sglang"]["counters"]["steps"] > 0 and rt["sglang"]["tau"] >= 1.0
    assert "SGLang + head" in capsys.readouterr().out
