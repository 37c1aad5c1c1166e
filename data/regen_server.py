"""Regeneration through a serving engine: any OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp's server).

`ServerEngine` is an `Engine` for regen_store.regenerate_jsonl, so resume, the JSONL format, skip counts and
Ctrl-C behave exactly as with eyas's own regeneration; only the answers come from the server. Conversations
run concurrently (at most `concurrency` requests in flight), each turn by turn: the prompt of turn k holds the
answers the server gave to turns < k, as eyas's own regeneration does.

Two request kinds:
- "completions" (default): eyas renders the prompt with the target's chat template and sends its token ids
  (`/v1/completions`, prompt as a token list: vLLM, SGLang and llama.cpp's server take it), so the server sees
  exactly the tokens eyas's own regeneration would; eos ids go as `stop_token_ids` (vLLM / SGLang).
- "chat": the messages go to `/v1/chat/completions` and the server applies its own template (TGI, or any
  server that takes no token prompts).
Caps are the same: an answer gets at most max_new_tokens and whatever max_length leaves after its prompt
(counted with the target's tokenizer); an answer the server cut (finish_reason "length") ends its
conversation. Transport errors, 408, 429 and 5xx are retried with exponential backoff; another 4xx skips the
conversation (counted under skipped, not written, retried by a rerun). The engine returns text, not target
states: hidden states come from `eyas data cache-hidden` or online training.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import httpx
from tqdm.auto import tqdm

from eyas.data.regenerate import Job, RegenConfig, RegenStats, finish_conversation, finish_turn, next_prompt
from eyas.models.errors import EyasError, InputError
from eyas.models.signals import GracefulStop

logger = logging.getLogger(__name__)

APIS = ("completions", "chat")
RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class ServerError(EyasError):
    """The server could not be reached or kept failing after every retry."""


@dataclass
class ServerConfig:
    url: str  # base URL: http://host:port or http://host:port/v1
    model: str | None = None  # served model name; None: the first one the server lists (GET /v1/models)
    api: str = "completions"
    concurrency: int = 16  # requests in flight
    retries: int = 5  # per request, after the first try
    timeout: float = 600.0  # seconds per request (a long answer on a busy CPU server takes minutes)
    api_key: str | None = None
    backoff: float = 0.5  # seconds before the first retry; doubles each time, at most 30 s

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise InputError(f"unknown server api {self.api!r}; choose one of {', '.join(APIS)}")
        if self.concurrency < 1:
            raise InputError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"server URL {self.url!r} must start with http:// or https://")

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


class Refused(Exception):
    """The server answered a request with a non-retryable status: the conversation is skipped."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text[:200]}")
        self.status = status


def target_eos_ids(spec: str, tokenizer) -> list[int]:
    """The ids that end an answer, as `Target.eos_ids` gives them (generation config and tokenizer), without
    loading the target's weights."""
    from transformers import GenerationConfig

    from eyas.models.loading import resolve_spec

    where, gguf_file, _ = resolve_spec(spec)
    try:
        ids = None if gguf_file else GenerationConfig.from_pretrained(where).eos_token_id
    except OSError:  # no generation_config.json
        ids = None
    ids = set([ids] if isinstance(ids, int) else ids or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class ServerEngine:
    """engine(todo, on_done, stop) -> RegenStats, generating every answer through `server`."""

    def __init__(self, server: ServerConfig, tokenizer, cfg: RegenConfig, eos_ids: Sequence[int] | None = None,
                 progress: bool = True) -> None:
        self.server, self.tok, self.cfg, self.progress = server, tokenizer, cfg, progress
        self.eos = list(eos_ids) if eos_ids is not None else [tokenizer.eos_token_id]
        self.model = server.model

    def __call__(self, conversations: list[tuple[int, list[dict]]], on_done: Callable[[Job], None],
                 stop: GracefulStop) -> RegenStats:
        return asyncio.run(self._run(conversations, on_done, stop))

    async def _run(self, conversations, on_done, stop) -> RegenStats:
        stats = RegenStats()
        loop = asyncio.get_running_loop()
        start = loop.time()
        queue = [Job(i, list(m)) for i, m in conversations]
        queue.reverse()  # pop() from the end serves the conversations in order
        in_flight: dict[int, Job] = {}
        bar = tqdm(total=len(queue), unit="conv", desc="regenerating (server)", disable=not self.progress)
        headers = {"Authorization": f"Bearer {self.server.api_key}"} if self.server.api_key else {}
        limits = httpx.Limits(max_connections=self.server.concurrency)
        async with httpx.AsyncClient(base_url=self.server.base, headers=headers, limits=limits,
                                     timeout=self.server.timeout) as client:
            if self.model is None:
                self.model = await self._first_model(client)

            async def worker() -> None:
                while queue and not stop:
                    job = queue.pop()
                    in_flight[job.id] = job
                    await self._conversation(client, job, stats)
                    del in_flight[job.id]
                    bar.update(1)
                    on_done(job)

            async def watch(tasks: list[asyncio.Task]) -> None:
                """Cancel every worker on a stop (a signal handler cannot cancel awaits) or a worker's failure."""
                while not all(t.done() for t in tasks):
                    if stop or any(t.done() and not t.cancelled() and t.exception() for t in tasks):
                        for t in tasks:
                            t.cancel()
                        return
                    await asyncio.sleep(0.1)

            tasks = [asyncio.create_task(worker()) for _ in range(min(self.server.concurrency, len(queue)))]
            watcher = asyncio.create_task(watch(tasks))
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await watcher
        bar.close()
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise errors[0]
        if stop:
            stats.stopped_by = stop.signum
            stats.dropped = len(in_flight)
        stats.seconds = loop.time() - start
        return stats

    async def _conversation(self, client: httpx.AsyncClient, job: Job, stats: RegenStats) -> None:
        """Every turn of `job`; a refused request ends it with the turns done so far (skipped if none)."""
        too_long = False
        while (ids := next_prompt(job, self.tok, self.cfg)) is not None:
            if len(ids) >= self.cfg.max_length:
                too_long = True
                break
            try:
                answer, tokens, cut = await self._answer(client, job, ids)
            except Refused as e:
                if not job.turns_done:
                    why = f"server refused the request ({e.status})"
                    if not stats.skipped.get(why):
                        logger.warning("the server refused conversation %d: %s", job.id, e)
                    stats.skipped[why] = stats.skipped.get(why, 0) + 1
                    job.out = []  # nothing written: a rerun tries it again
                    return
                break
            finish_turn(job, answer, tokens, cut, stats)
        finish_conversation(job, too_long, stats)

    async def _answer(self, client: httpx.AsyncClient, job: Job, prompt: list[int]) -> tuple[str, int, bool]:
        """(answer text, its token count, cut) of the job's next turn."""
        cfg = self.cfg
        body: dict[str, Any] = {"model": self.model, "temperature": cfg.temperature, "top_p": cfg.top_p,
                                "max_tokens": min(cfg.max_new_tokens, cfg.max_length - len(prompt)),
                                "seed": cfg.seed * 1_000_003 + job.id + job.turns_done}
        if self.server.api == "completions":
            body.update(prompt=prompt, stop_token_ids=self.eos)
            choice, usage = await self._post(client, "/completions", body)
            text = choice["text"]
        else:
            body["messages"] = job.out
            choice, usage = await self._post(client, "/chat/completions", body)
            text = choice["message"]["content"] or ""
        tokens = (usage or {}).get("completion_tokens")
        if tokens is None:
            tokens = len(self.tok(text, add_special_tokens=False)["input_ids"])
        return text, int(tokens), choice.get("finish_reason") != "stop"

    async def _post(self, client: httpx.AsyncClient, path: str, body: dict) -> tuple[dict, dict | None]:
        data = await self._request(client, "POST", path, body)
        try:
            return data["choices"][0], data.get("usage")
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"{self.server.base}{path} answered without choices: {str(data)[:200]}") from None

    async def _first_model(self, client: httpx.AsyncClient) -> str:
        data = await self._request(client, "GET", "/models", None)
        models = [m.get("id") for m in (data or {}).get("data", [])]
        if not models:
            raise ServerError(f"{self.server.base}/models lists no model; pass --server-model NAME")
        return models[0]

    async def _request(self, client: httpx.AsyncClient, method: str, path: str, body: dict | None) -> Any:
        """The JSON answer; retryable failures are retried with backoff, a refusal raises Refused."""
        s = self.server
        for attempt in range(s.retries + 1):
            try:
                response = await client.request(method, path, json=body)
                if response.status_code not in RETRY_STATUS:
                    if response.is_error:
                        raise Refused(response.status_code, response.text)
                    return response.json()
                failure = f"status {response.status_code}"
            except httpx.TransportError as e:
                failure = f"{type(e).__name__}: {e}"
            if attempt < s.retries:
                logger.info("%s %s%s failed (%s); retry %d of %d", method, s.base, path, failure, attempt + 1,
                            s.retries)
                await asyncio.sleep(min(s.backoff * 2 ** attempt, 30.0))
        raise ServerError(f"{method} {s.base}{path} failed {s.retries + 1} times (last: {failure}); is the server "
                          "running? Finished conversations are written: rerun the same command to continue")
