"""`eyas generate` and `eyas chat` on a tiny target saved as an ordinary HF folder."""

import pytest

from eyas.inference import SpeculativeGenerator
from eyas.inference.cli import main
from eyas.models import load_head, save_head
from tests.helpers.inference import greedy, make_head
from tests.helpers.tiny import tiny_target, tiny_tokenizer


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
                 "--prompt", "hello world", "--max-new-tokens", "6", "--tree", "chain", "--depth", "3", "--stats",
                 "--dtype", "fp32"])  # the dtype greedy output is token-identical in, on every CPU kind
    out, err = capsys.readouterr()
    assert code == 0
    from eyas.models import Target

    target = Target.load(str(folders / "target"), dtype="fp32")
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
    stream, turns = SpeculativeGenerator.stream, []  # per turn: the token ids the generator was given, the reply

    def recording(self, prompt, **kw):
        ids, pieces = self.encode(prompt), list(stream(self, prompt, **kw))
        turns.append((ids, "".join(pieces)))
        yield from pieces

    monkeypatch.setattr(SpeculativeGenerator, "stream", recording)
    code = main(["chat", "--target", str(folders / "target"), "--head", str(folders / "head"), "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0 and out == "".join(reply + "\n" for _, reply in turns)  # one streamed reply per turn
    (first, reply), (second, _) = turns
    tokenizer = tiny_tokenizer()  # the target folder's
    said = tokenizer(reply, add_special_tokens=False)["input_ids"]
    asked = tokenizer("the world", add_special_tokens=False)["input_ids"]
    # turn 2's prompt: turn 1's whole prompt, turn 1's reply, then the new message
    assert said and second[:len(first) + len(said)] == first + said
    rest = second[len(first) + len(said):]
    assert any(rest[i:i + len(asked)] == asked for i in range(len(rest)))


def test_missing_head_folder_is_a_clear_error(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--head", str(folders / "nope"), "--prompt", "a"])
    assert code == 2 and "config.json is missing" in capsys.readouterr().err


def test_head_for_another_target_is_refused(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--head", str(folders / "other-head"),
                 "--prompt", "a"])
    assert code == 2 and "vocab size mismatch" in capsys.readouterr().err
    assert load_head(folders / "other-head").config.vocab_size == 384
