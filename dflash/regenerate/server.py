"""Backend for an OpenAI-compatible server (`vllm serve`, SGLang): many requests in flight, retries with
exponential backoff, and start-up checks that the server serves the intended model with the target's
tokenizer. Standard library only (urllib)."""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from dflash.errors import BadInput, DflashError
from dflash.logs import get_logger
from dflash.regenerate.core import Progress, Reply, SamplingParams, derive_seed

log = get_logger(__name__)

RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
CONTEXT_ERROR_HINTS = ("maximum context length", "context length", "too long", "max_model_len",
                       "longer than the maximum")
PROBE_TEXT = "Hello, world! The quick brown fox jumps over 13 lazy dogs.\nünïcödé 東京 — ok?"


class ServerError(DflashError):
    """The server failed (after the retries) or answered something unusable."""


class _HTTPStatus(Exception):
    def __init__(self, status: int, body: str, retry_after: float | None = None):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body, self.retry_after = status, body, retry_after


def _api_root(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (vLLM serves /tokenize there)."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class OpenAIServerBackend:
    """Chat completions against `base_url` (e.g. http://127.0.0.1:8000/v1).

    `tokenizer` (the target's, optional but recommended) lets the backend skip prompts that are too long
    before sending them and check that the server tokenizes like the target."""

    name = "openai-server"

    def __init__(self, base_url: str, model: str | None = None, tokenizer=None, concurrency: int = 64,
                 retries: int = 6, backoff_s: float = 1.0, timeout_s: float = 3600.0, api_key: str | None = None,
                 check: bool = True):
        if not base_url.startswith(("http://", "https://")):
            raise BadInput(f"--server {base_url!r}: expected a URL like http://127.0.0.1:8000/v1")
        if concurrency < 1:
            raise BadInput(f"concurrency must be >= 1, got {concurrency}")
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.concurrency, self.retries, self.backoff_s, self.timeout_s = concurrency, retries, backoff_s, timeout_s
        self.api_key = api_key
        self.model = model
        self.max_model_len: int | None = None
        self.tokenizer_check = "not run"
        # until the server has answered once, a refused connection means nothing listens there (a wrong URL,
        # a server not started): not a blip to retry. After that it is a restart in progress, and retried.
        self.answered = False
        self._stop_strings: list[str] = []
        # vLLM's and SGLang's extra sampling fields; a server that refuses them (transformers serve answers 422
        # "Unexpected fields") gets requests without them from its first refusal on
        self._extras: dict[str, Any] = {"skip_special_tokens": False}
        if tokenizer is not None:
            from dflash.regenerate.hf import stop_token_ids

            self._stop_strings = [tokenizer.convert_ids_to_tokens(t) for t in stop_token_ids(tokenizer)]
        if check:
            self.check_model()
            self.check_tokenizer()

    # -------------------------------------------------------------------------------------- HTTP
    def _request(self, method: str, url: str, body: dict | None = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as resp:
                self.answered = True
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            self.answered = True
            text = exc.read().decode(errors="replace") if exc.fp is not None else ""
            retry_after = None
            try:
                retry_after = float(exc.headers.get("Retry-After")) if exc.headers.get("Retry-After") else None
            except (TypeError, ValueError):
                pass
            raise _HTTPStatus(exc.code, text, retry_after) from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ServerError(f"{url}: the server's answer is not JSON: {raw[:200]!r}") from None

    def call(self, method: str, url: str, body: dict | None = None, timeout: float | None = None) -> Any:
        """One request, retried on connection errors, timeouts, 429 and 5xx with exponential backoff; a refused
        connection before the server ever answered fails at once (`_refused_at_start`)."""
        last = ""
        for attempt in range(self.retries + 1):
            wait = min(60.0, self.backoff_s * 2 ** attempt) * random.uniform(1.0, 1.25)
            try:
                return self._request(method, url, body, timeout)
            except _HTTPStatus as exc:
                if exc.status not in RETRY_STATUS:
                    raise
                last = str(exc)
                if exc.retry_after is not None:
                    wait = max(wait, min(exc.retry_after, 120.0))
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut short
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, ConnectionRefusedError) and not self.answered:
                    raise self._refused_at_start(method, url) from None
                last = f"{type(reason).__name__}: {reason}"
            if attempt < self.retries:
                log.warning("%s %s failed (%s); retry %d/%d in %.1fs", method, url, last, attempt + 1,
                            self.retries, wait)
                time.sleep(wait)
        raise ServerError(f"{method} {url} failed {self.retries + 1} times, last: {last}; is the server up and "
                          "reachable (check --server)?")

    def _refused_at_start(self, method: str, url: str) -> ServerError:
        where = urlsplit(url).netloc
        return ServerError(f"{method} {url}: connection refused: nothing listens on {where} (not retried: the "
                           "server has not answered yet); start the server, or point --server at its API root")

    # ------------------------------------------------------------------------------------ checks
    def check_model(self) -> None:
        url = f"{self.base_url}/models"
        try:
            listing = self.call("GET", url, timeout=60)
        except _HTTPStatus as exc:
            raise ServerError(f"GET {url}: {exc}; is {self.base_url} an OpenAI-compatible API root (it usually "
                              "ends in /v1)?") from None
        entries = [m for m in (listing.get("data") or []) if isinstance(m, dict) and "id" in m]
        ids = [m["id"] for m in entries]
        if self.model is None:
            if len(ids) != 1:
                raise BadInput(f"the server at {self.base_url} serves {len(ids)} models ({', '.join(ids) or 'none'}); "
                               "choose one with --model")
            self.model = ids[0]
        elif self.model not in ids:
            raise BadInput(f"--model {self.model!r} is not served by {self.base_url}; it serves: "
                           f"{', '.join(ids) or 'no model'}")
        entry = entries[ids.index(self.model)]
        if isinstance(entry.get("max_model_len"), int):
            self.max_model_len = entry["max_model_len"]
        log.info("server %s serves %s (max_model_len %s)", self.base_url, self.model, self.max_model_len)

    def _probe_texts(self) -> list[str]:
        """A fixed text plus words of the target's own vocabulary spread over its ids."""
        tok = self.tokenizer
        n = len(tok)
        spread = sorted({round(k * (n - 1) / 63) for k in range(64)})  # first to last id
        sample = tok.decode(spread, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return [PROBE_TEXT, sample]

    def check_tokenizer(self) -> None:
        """The server must tokenize a probe text (and render a chat prompt) to the target tokenizer's ids."""
        if self.tokenizer is None:
            self.tokenizer_check = "skipped: no local tokenizer"
            log.warning("no local tokenizer: the server's tokenizer is not checked against the target's")
            return
        root = _api_root(self.base_url)
        for url in (f"{root}/tokenize", f"{self.base_url}/tokenize"):
            mismatch = None
            try:
                for text in self._probe_texts():
                    got = self.call("POST", url, {"model": self.model, "prompt": text, "add_special_tokens": False},
                                    timeout=60).get("tokens")
                    want = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                    if got != want:
                        mismatch = (text, got, want)
                        break
            except _HTTPStatus as exc:
                if exc.status in (404, 405):
                    continue  # no such endpoint here
                if exc.status in (400, 422):  # a /tokenize of another shape: cannot compare
                    self.tokenizer_check = f"skipped: {url} does not take vLLM's request ({exc})"
                    log.warning("the server's tokenizer was not checked: %s", self.tokenizer_check)
                    return
                raise ServerError(f"POST {url}: {exc}") from None
            if mismatch is not None:
                text, got, want = mismatch
                raise BadInput(f"the server's tokenizer differs from the target's: {text[:40]!r}... tokenizes to "
                               f"{str(got)[:80]} there and {str(want)[:80]} here; serve the target model with its "
                               "own tokenizer (or point --tokenizer-path / the config at the served model's)")
            self.tokenizer_check = f"ok ({url})"
            self._check_chat_template(url)
            log.info("server tokenizer matches the target's (%s)", url)
            return
        self.tokenizer_check = "skipped: the server has no /tokenize endpoint"
        log.warning("the server has no /tokenize endpoint: its tokenizer was not checked against the target's")

    def _check_chat_template(self, url: str) -> None:
        messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi there"}]
        try:
            got = self.call("POST", url, {"model": self.model, "messages": messages, "add_generation_prompt": True,
                                          "add_special_tokens": False}, timeout=60).get("tokens")
        except _HTTPStatus:
            self.tokenizer_check += "; chat template not compared (the server tokenizes plain text only)"
            return
        from dflash.regenerate.hf import render_prompt

        want = render_prompt(self.tokenizer, messages, SamplingParams())
        if got != want:
            log.warning("the server renders the chat template differently from the target's tokenizer (%d vs %d "
                        "tokens): answers follow the server's template", len(got or []), len(want))
            self.tokenizer_check += "; chat template DIFFERS"
        else:
            self.tokenizer_check += "; chat template matches"

    # ----------------------------------------------------------------------------------- generate
    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "server": self.base_url, "model": self.model,
                "max_model_len": self.max_model_len, "concurrency": self.concurrency,
                "tokenizer_check": self.tokenizer_check}

    def prompt_limit(self, params: SamplingParams) -> int | None:
        if params.max_prompt_tokens is not None:
            return params.max_prompt_tokens
        if self.max_model_len is None:
            return None
        limit = self.max_model_len - params.max_new_tokens
        if limit < 1:
            raise BadInput(f"max_new_tokens {params.max_new_tokens} leaves no room for a prompt in the server's "
                           f"max_model_len {self.max_model_len}; lower max_new_tokens")
        return limit

    def _complete(self, prefix: list[dict[str, str]], params: SamplingParams, seed: int) -> Reply:
        body: dict[str, Any] = {"model": self.model, "messages": prefix, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "top_p": params.top_p, "seed": seed}
        if params.thinking == "disable":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        url = f"{self.base_url}/chat/completions"
        # one try, then at most one more per extra field the server can refuse (each refusal drops one for good)
        for _ in range(len(self._extras) + 1):
            extras = dict(self._extras)
            try:
                out = self.call("POST", url, {**body, **extras})
                break
            except _HTTPStatus as exc:
                if exc.status == 400 and any(h in exc.body.lower() for h in CONTEXT_ERROR_HINTS):
                    return Reply(None)  # the server says the prompt does not fit
                refused = [k for k in extras if k in exc.body] if exc.status in (400, 422) else []
                if not refused:
                    raise ServerError(f"POST {url}: {exc}") from None
                if any(k in self._extras for k in refused):
                    log.warning("the server refuses %s (HTTP %d): requests go without it (the stop token's text is "
                                "cut from the answers instead)", ", ".join(refused), exc.status)
                for k in refused:
                    self._extras.pop(k, None)
                last = exc
        else:
            raise ServerError(f"POST {url}: the server still refuses a field after it was dropped ({last})")
        try:
            choice = out["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"POST {url}: unexpected answer {str(out)[:300]}") from None
        text = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning and params.thinking == "keep":  # a server-side reasoning parser split it off: put it back
            text = f"<think>\n{reasoning.strip()}\n</think>\n\n{text.lstrip()}"
        finish = choice.get("finish_reason")
        if finish == "stop":
            for s in self._stop_strings:  # some servers keep the stop token's text with skip_special_tokens off
                if text.endswith(s):
                    text = text[: -len(s)]
                    break
        usage = out.get("usage") or {}
        return Reply(text, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                     new_tokens=int(usage.get("completion_tokens") or 0), hit_max_new_tokens=finish == "length")

    def generate(self, prefixes: list[list[dict[str, str]]], params: SamplingParams,
                 progress: Progress | None = None) -> list[Reply]:
        params.validate()
        limit = self.prompt_limit(params) if self.tokenizer is not None else None
        replies: list[Reply | None] = [None] * len(prefixes)
        todo = []
        if limit is not None:
            from dflash.regenerate.hf import render_prompt

            for i, p in enumerate(prefixes):
                n = len(render_prompt(self.tokenizer, p, params))
                if n > limit:
                    replies[i] = Reply(None, prompt_tokens=n)
                else:
                    todo.append(i)
            if progress is not None and len(todo) < len(prefixes):
                progress(len(prefixes) - len(todo), 0)
        else:
            todo = list(range(len(prefixes)))

        def work(i: int) -> Reply:
            return self._complete(prefixes[i], params, derive_seed(params.seed, "request", i))

        for i, reply in _run_concurrently(work, todo, self.concurrency):
            replies[i] = reply
            if progress is not None:
                progress(1, reply.new_tokens)
        return replies  # type: ignore[return-value]


def _run_concurrently(fn, items: list[int], concurrency: int):
    """Yield (item, fn(item)) as they finish, `concurrency` at a time, on daemon threads (an interrupted
    run exits without waiting for requests in flight). The first error stops the rest and is raised."""
    if not items:
        return
    work: queue.Queue = queue.Queue()
    for it in items:
        work.put(it)
    done: queue.Queue = queue.Queue()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                it = work.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((it, fn(it), None))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                done.put((it, None, exc))

    threads = [threading.Thread(target=worker, daemon=True, name=f"dflash-regen-{k}")
               for k in range(min(concurrency, len(items)))]
    for t in threads:
        t.start()
    try:
        for _ in range(len(items)):
            while True:
                try:
                    it, result, exc = done.get(timeout=0.5)
                    break
                except queue.Empty:
                    continue
            if exc is not None:
                raise exc
            yield it, result
    finally:
        stop.set()
