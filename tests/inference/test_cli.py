"""`eyas generate` and `eyas chat` on a tiny target saved as an ordinary HF folder."""

import pytest

from eyas.inference.cli import main
from eyas.models import load_head, save_head
from tests.helpers.inference import greedy, make_head
from tests.helpers.tiny import tiny_target


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = tiny_target("llama")
    target.model.save_pretrained(root / "target")
    target.tokenizer.save_pretrained(root / "target")
    save_head(make_head(target), root / "head")
    other = tiny_target("llama", vocab_size=384)
    save_head(make_head(other), root / "other-head")
    return root


def test_generate_streams_the_greedy_reply(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--head", str(folders / "head"),
                 "--prompt", "hello world", "--max-new-tokens", "6", "--tree", "chain", "--depth", "3", "--stats"])
    out, err = capsys.readouterr()
    assert code == 0
    from eyas.models import Target

    target = Target.load(str(folders / "target"))
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}],
                                               add_generation_prompt=True, tokenize=True)["input_ids"]
    expected = greedy(target, ids, 6)
    if 3 in expected:  # eos ends the reply
        expected = expected[:expected.index(3) + 1]
    assert out.strip() == target.tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert "tau" in err and "tok/s" in err


def test_chat_keeps_the_conversation(folders, capsys, monkeypatch):
    lines = iter(["hello", "the world", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code = main(["chat", "--target", str(folders / "target"), "--head", str(folders / "head"), "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0 and len(out.strip().splitlines()) >= 2  # one streamed reply per turn


def test_missing_head_folder_is_a_clear_error(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--head", str(folders / "nope"), "--prompt", "a"])
    assert code == 2 and "config.json is missing" in capsys.readouterr().err


def test_head_for_another_target_is_refused(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--head", str(folders / "other-head"),
                 "--prompt", "a"])
    assert code == 2 and "vocab size mismatch" in capsys.readouterr().err
    assert load_head(folders / "other-head").config.vocab_size == 384
