"""A small OpenAI-compatible HTTP server for tests: serves a transformers causal LM the way vLLM does.

Endpoints: `GET /v1/models`, `POST /v1/chat/completions` (greedy at temperature 0, else sampled with
the request's seed; `chat_template_kwargs`, `max_tokens`, `skip_special_tokens`), `POST /tokenize`
(vLLM's: `prompt` or `messages`). Knobs for failure tests: `fail_first` (answer the first N chat requests
with 503), `tokenize=False` (no /tokenize endpoint), `reject_fields` (refuse requests carrying these fields
with 422, as transformers serve refuses vLLM's `skip_special_tokens`).

    server = OpenAIServer(model, tokenizer, model_name="tiny").start()
    ... server.base_url  # http://127.0.0.1:PORT/v1
    server.stop()

Standalone: `python tests/openai_server.py configs/tiny-cpu.yaml --port 8000`.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


class OpenAIServer:
    def __init__(self, model, tokenizer, model_name: str = "tiny", max_model_len: int | None = None,
                 fail_first: int = 0, tokenize: bool = True, host: str = "127.0.0.1", port: int = 0,
                 reject_fields: tuple[str, ...] = ()):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.model_name = model_name
        cfg = model.config
        self.max_model_len = max_model_len or getattr(cfg, "max_position_embeddings", None)
        self.fail_first, self.tokenize_enabled = fail_first, tokenize
        # request fields this server refuses as transformers serve does (422 "Unexpected fields in the request")
        self.reject_fields = reject_fields
        self.rejected = 0
        self.chat_requests = 0  # including the failed ones
        self.failed = 0
        self._lock = threading.Lock()  # one generate at a time (the model is not thread-safe)
        self._count_lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                        name="openai-server")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ------------------------------------------------------------------------------------ logic
    def _vocab_limit(self) -> int:
        return len(self.tokenizer)

    def _stop_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.get_vocab().get("<|im_end|>")
        if im_end is not None:
            ids.add(im_end)
        return sorted(i for i in ids if i is not None)

    def _render(self, messages, add_generation_prompt: bool, kwargs: dict) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def _generate(self, prompt: list[int], max_tokens: int, temperature: float, top_p: float, seed: int | None):
        from transformers import GenerationConfig

        device = next(self.model.parameters()).device
        logits_dim = self.model.get_output_embeddings().weight.shape[0]
        # the extra embedding rows of a random-weight target have no text: never sample them
        suppress = list(range(self._vocab_limit(), logits_dim)) or None
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "eos_token_id": self._stop_ids(),
                                  "pad_token_id": self.tokenizer.pad_token_id, "suppress_tokens": suppress}
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs["do_sample"] = False
        ids = torch.tensor([prompt], device=device)
        with self._lock, torch.random.fork_rng():
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=GenerationConfig(**kwargs))
        return out[0, len(prompt):].tolist()

    def chat(self, body: dict) -> tuple[int, dict]:
        with self._count_lock:
            self.chat_requests += 1
            if self.failed < self.fail_first:
                self.failed += 1
                return 503, {"error": {"message": "Service Unavailable (test: warming up)", "code": 503}}
        unexpected = {k for k in body if k in self.reject_fields}
        if unexpected:
            with self._count_lock:
                self.rejected += 1
            return 422, {"detail": f"Unexpected fields in the request: {unexpected}"}
        if body.get("model") != self.model_name:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}}
        kwargs = body.get("chat_template_kwargs") or {}
        prompt = self._render(body["messages"], True, kwargs)
        max_tokens = int(body.get("max_tokens") or 16)
        if self.max_model_len is not None and len(prompt) + max_tokens > self.max_model_len:
            return 400, {"error": {"message": f"This model's maximum context length is {self.max_model_len} tokens. "
                                              f"However, you requested {len(prompt) + max_tokens} tokens "
                                              f"({len(prompt)} in the messages, {max_tokens} in the completion).",
                                   "code": 400}}
        gen = self._generate(prompt, max_tokens, float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)),
                             body.get("seed"))
        stops = set(self._stop_ids())
        cut = next((k for k, t in enumerate(gen) if t in stops), None)
        content = gen if cut is None else gen[:cut]
        text = self.tokenizer.decode(content, skip_special_tokens=bool(body.get("skip_special_tokens", True)),
                                     clean_up_tokenization_spaces=False)
        return 200, {
            "id": f"chatcmpl-{self.chat_requests}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "length" if cut is None else "stop"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(gen if cut is None else gen[:cut + 1]),
                      "total_tokens": len(prompt) + len(gen)},
        }

    def tokenize(self, body: dict) -> tuple[int, dict]:
        if "messages" in body:
            tokens = self._render(body["messages"], bool(body.get("add_generation_prompt", True)),
                                  body.get("chat_template_kwargs") or {})
        else:
            tokens = self.tokenizer(body.get("prompt", ""),
                                    add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        return 200, {"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len}

    def models(self) -> tuple[int, dict]:
        return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "test",
                                                 "max_model_len": self.max_model_len}]}

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args) -> None:  # quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/") == "/v1/models":
                    self._send(*server.models())
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except json.JSONDecodeError:
                    self._send(400, {"error": {"message": "invalid JSON"}})
                    return
                path = self.path.rstrip("/")
                if path == "/v1/chat/completions":
                    self._send(*server.chat(body))
                elif path == "/tokenize" and server.tokenize_enabled:
                    self._send(*server.tokenize(body))
                else:
                    self._send(404, {"detail": "Not Found"})

        return Handler


def main() -> None:  # pragma: no cover - manual use
    import argparse

    from dflash.config import load_config
    from dflash.inputs import load_tokenizer
    from dflash.models.target import build_hf_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="tiny")
    a = p.parse_args()
    cfg = load_config(a.config, [])
    model = build_hf_model(cfg.target.path, cfg.target.random_init, cfg.target.dtype, seed=cfg.seed)
    server = OpenAIServer(model, load_tokenizer(cfg), model_name=a.model_name, port=a.port).start()
    print(f"serving {a.model_name} at {server.base_url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":  # pragma: no cover
    main()
