"""``longsft serve``: an OpenAI-compatible chat endpoint over the HF backend (one model, greedy).

    longsft serve model=runs/tiny/stages/s4k/best [tokenizer=qwen] [port=8000] [host=127.0.0.1]

For checkpoints without a serving stack (and for the tests of the ``openai`` backend): handles
``POST /v1/chat/completions`` (the last user message; ``max_tokens``) and ``GET /v1/models``,
one request at a time. Not a production server: use vLLM or SGLang for throughput.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from longsft.train.config import ConfigError, from_args


@dataclass
class ServeConfig:
    model: str = ""
    tokenizer: str | None = None
    recipe: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_new_tokens: int = 512
    dtype: str = "auto"


def serve(argv: list[str]) -> int:
    cfg = from_args(ServeConfig, argv, "model=PATH port=8000")
    if not cfg.model:
        raise ConfigError("model= is required")
    from .backends import HFBackend
    from .harness import EvalConfig, model_config

    backend = HFBackend(model_config(EvalConfig(model=cfg.model, tokenizer=cfg.tokenizer, recipe=cfg.recipe)),
                        cfg.max_new_tokens, dtype=cfg.dtype)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj, ensure_ascii=False).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": cfg.model, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if not self.path.rstrip("/").endswith("/chat/completions"):
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                prompt = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
            except (ValueError, KeyError, IndexError) as e:
                return self._send(400, {"error": {"message": f"bad request: {e}"}})
            with lock:  # one generation at a time; max_tokens is per request
                backend.max_new_tokens = int(body.get("max_tokens") or cfg.max_new_tokens)
                g = backend.generate(prompt)
            self._send(200, {"object": "chat.completion", "model": body.get("model", cfg.model),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": g.text}}],
                             "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.gen_tokens,
                                       "total_tokens": g.prompt_tokens + g.gen_tokens}})

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((cfg.host, cfg.port), Handler)
    print(f"longsft serve: {cfg.model} on http://{cfg.host}:{httpd.server_address[1]}/v1", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0
