"""Regeneration through an OpenAI-compatible server: a fake one on 127.0.0.1 that answers with greedy HF
`generate` of the tiny target gives the same JSONL and counts as eyas's own regeneration; retries, refusals,
bounded concurrency, resume and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import datasets
import pytest
import torch

from eyas.data.regen_server import ServerConfig, ServerEngine, ServerError
from eyas.data.regen_store import regenerate_jsonl
from eyas.data.regenerate import RegenConfig
from eyas.inference.cli import main
from tests.data.test_cli import tiny_folder_and_chats
from tests.data.test_regenerate import EOS, conversations
from tests.helpers.tiny import tiny_target

CFG = RegenConfig(max_new_tokens=8, max_length=40)


class FakeServer:
    """OpenAI-compatible completions and chat completions, answered by greedy `generate` of `target`'s model.
    `fail(n, path, body)` may return an HTTP status to answer the n-th request with instead."""

    def __init__(self, target, fail=lambda n, path, body: None, delay: float = 0.0) -> None:
        self.model, self.tok, self.fail, self.delay = target.model, target.tokenizer, fail, delay
        self.requests: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.lock, self.generating = threading.Lock(), threading.Lock()

    def __enter__(self) -> "FakeServer":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self._reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload = owner.answer(self.path, body)
                self._reply(status, payload)

            def _reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def render(self, messages: list[dict]) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        with self.lock:
            n = len(self.requests)
            self.requests.append((path, body))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            status = self.fail(n, path, body)
            if status is not None:
                return status, {"error": {"message": "injected failure"}}
            if path == "/v1/chat/completions":  # the server's own template; its generation config's eos ids
                prompt, stop = self.render(body["messages"]), EOS
            else:
                prompt, stop = body["prompt"], body["stop_token_ids"]
            with self.generating, torch.no_grad():
                ids = torch.tensor([prompt])
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["max_tokens"],
                                          do_sample=False, eos_token_id=stop, pad_token_id=1)
            generated = out[0, len(prompt):].tolist()
            text = self.tok.decode(generated, skip_special_tokens=True)
            choice = {"index": 0, "finish_reason": "stop" if generated[-1] in stop else "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if "chat" in path else {"text": text})
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(generated)}
            return 200, {"choices": [choice], "usage": usage}
        finally:
            with self.lock:
                self.in_flight -= 1


def dataset(n=10):
    convs = conversations(n)
    convs[4] = [{"role": "user", "content": " ".join(["w7"] * 40)}, {"role": "assistant", "content": "w1"}]  # too long
    convs[6] = [{"role": "assistant", "content": "w1"}]  # no question
    return datasets.Dataset.from_dict({"messages": convs, "problem": [""] * (n - 1) + ["empty"]})


def engine(server, target, api="completions", concurrency=3, **kw):
    return ServerEngine(ServerConfig(server.url, api=api, concurrency=concurrency, backoff=0.01, **kw),
                        target.tokenizer, CFG, EOS, progress=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """eyas's own regeneration of dataset(): (sorted JSONL lines, stats)."""
    out = tmp_path_factory.mktemp("ref") / "own.jsonl"
    stats = regenerate_jsonl(tiny_target(), dataset(), out, CFG, batch_size=3, eos_ids=EOS, progress=False)
    return sorted(out.read_text().splitlines()), stats


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_server_regeneration_equals_eyas_own(tmp_path, reference, api):
    target = tiny_target()
    lines, own = reference
    with FakeServer(target, delay=0.05) as server:
        stats = regenerate_jsonl(None, dataset(), tmp_path / "out.jsonl", CFG, engine=engine(server, target, api))
    assert sorted((tmp_path / "out.jsonl").read_text().splitlines()) == lines
    assert (stats.conversations, stats.useful_tokens, stats.skipped, stats.stored) == \
        (own.conversations, own.useful_tokens, own.skipped, own.stored)
    assert set(own.skipped) == {"first prompt reaches max_length", "no user turn before an assistant turn"}
    assert any(json.loads(line)["messages"][-1]["content"] for line in lines)
    assert 1 < server.max_in_flight <= 3  # bounded concurrency, and concurrent
    assert all(body["model"] == "tiny" and body["max_tokens"] <= CFG.max_new_tokens for _, body in server.requests)


def test_retries_refusals_and_resume(tmp_path, reference):
    target = tiny_target()
    lines, _ = reference
    def flaky(n, path, body):
        if n < 4:
            return 503  # the first requests meet a server still starting: retried
        if body["prompt"] == server.render(dataset()[1]["messages"][:1]):
            return 400  # conversation 1 is refused: skipped, not written
        return None

    with FakeServer(target, fail=flaky) as server:
        stats = regenerate_jsonl(None, dataset(), tmp_path / "out.jsonl", CFG, engine=engine(server, target))
    assert stats.skipped["server refused the request (400)"] == 1
    written = {json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()}
    assert 1 not in written and len(written) == len(lines) - 1
    with FakeServer(target) as server:  # a rerun asks only for what is missing
        regenerate_jsonl(None, dataset(), tmp_path / "out.jsonl", CFG, engine=engine(server, target))
    assert sorted((tmp_path / "out.jsonl").read_text().splitlines()) == lines
    assert len(server.requests) == 1  # conversation 1 has one turn


def test_ctrl_c_keeps_the_finished_and_a_rerun_completes(tmp_path, reference):
    target = tiny_target()
    lines, _ = reference
    done = []

    def ctrl_c_at_the_second(job):
        done.append(job.id)
        if len(done) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with FakeServer(target, delay=0.2) as server:
        stats = regenerate_jsonl(None, dataset(), tmp_path / "out.jsonl", CFG, engine=engine(server, target),
                                 on_done=ctrl_c_at_the_second)
        assert stats.stopped_by == signal.SIGINT and 2 <= stats.stored < len(lines)
        regenerate_jsonl(None, dataset(), tmp_path / "out.jsonl", CFG, engine=engine(server, target))
    assert sorted((tmp_path / "out.jsonl").read_text().splitlines()) == lines


def test_unreachable_server_and_hidden_states_are_refused_clearly(tmp_path):
    target = tiny_target()
    with FakeServer(target) as server:
        url = server.url  # closed below: nothing listens there any more
    with pytest.raises(ServerError, match="is the server running"):
        regenerate_jsonl(None, dataset(), tmp_path / "out.jsonl", CFG,
                         engine=engine(server, target, retries=1, timeout=2.0, model="tiny"))
    with pytest.raises(ValueError, match="cache-hidden"):
        regenerate_jsonl(None, dataset(), tmp_path / "out.jsonl", CFG, engine=engine(server, target, model="tiny"),
                         cache_hidden=tmp_path / "hidden")
    with pytest.raises(ValueError, match="http://"):
        ServerConfig("localhost:8000")
    assert url.startswith("http://127.0.0.1:")


def test_cli_regenerates_through_a_server(tmp_path, monkeypatch, capsys):
    folder, src = tiny_folder_and_chats(tmp_path, monkeypatch)
    target = tiny_target()  # the same seeded model as the folder holds
    with FakeServer(target) as server:
        assert main(["data", "regenerate", "--target", str(folder), "--source", str(src), "--out",
                     str(tmp_path / "regen.jsonl"), "--max-new-tokens", "6", "--batch-size", "4",
                     "--server", server.url]) == 0
    assert "useful tokens/s" in capsys.readouterr().out
    assert len((tmp_path / "regen.jsonl").read_text().splitlines()) == 12
    assert {body["stop_token_ids"][-1] for _, body in server.requests} == {3}  # the target's eos (generation config)
