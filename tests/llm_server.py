"""A local OpenAI-compatible HTTP server for the LLM-client, synthesis and ConStory tests
(``POST /v1/chat/completions``).

Real HTTP, deterministic "models": the reply is computed from the model name and the prompt.
``requests`` counts calls per model. The first reply to every distinct ERHG prompt is malformed,
so every edit exercises the client's retry; prompts containing ``XYZZY`` never get a valid reply.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def reply_for(model: str, messages: list[dict], seen: set) -> str:
    prompt = messages[0]["content"]
    if model == "constory-judge":
        import constory_judge

        return constory_judge.answer(prompt)
    if model == "editor":
        if "XYZZY" in prompt:
            return "I cannot do that."
        if prompt not in seen:
            seen.add(prompt)
            return "Sure! Here is the sentence you asked for"  # no JSON: the client must retry
        sentence = re.search(r"<<<(.*)>>>", prompt, re.S).group(1)
        kind = re.search(r'type "(\w+)"', prompt).group(1)
        if kind == "fabrication":
            return json.dumps({"perturbed": "A masked rider burned the granary at midnight."})
        return "```json\n" + json.dumps({"perturbed": sentence.rstrip(".。") + " (edited)."}) + "\n```"
    if model.startswith("gen-"):
        sid = re.search(r"STORY-(\d+)", prompt).group(1)
        text = f"A faithful account of story {sid}." if model == "gen-good" else f"An invented tale about {sid}."
        return json.dumps({"summary": text})
    summary = prompt.split("Summary:\n", 1)[1].split("\n\nTwo reviewers", 1)[0]
    faithful = "faithful" in summary
    if model == "judge-a":
        return json.dumps({"score": 5 if faithful else 1, "reason": "checked",
                           **({} if faithful else {"hallucination_types": ["Event"]})})
    if model == "judge-b":
        return json.dumps({"score": 4, "reason": "looks fine"})
    if model == "arbiter":
        return json.dumps({"reason": "invented", "score": 2, "hallucination_types": ["Fictional Event"]})
    raise ValueError(model)


class Server:
    """The local endpoint. ``answer(body) -> (status, headers, text)`` replies to one request body
    (default: :func:`reply_for`, status 200; an error's ``text`` as a dict is sent as the whole body);
    ``requests`` counts calls per model, ``seen`` holds (time, client port, body) per request,
    ``most_in_flight`` the most requests answered at once (``delay``: seconds each answer takes).
    HTTP/1.1 with keep-alive, as real servers do."""

    def __init__(self, answer=None, delay: float = 0.0):
        self.requests: Counter = Counter()
        self.seen: list = []
        self.lock, self.in_flight, self.most_in_flight = threading.Lock(), 0, 0  # requests answered at once
        prompts: set = set()
        answer = answer or (lambda body: (200, {}, reply_for(body["model"], body["messages"], prompts)))
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests[body["model"]] += 1
                    outer.seen.append((time.monotonic(), self.client_address[1], body))
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                try:
                    time.sleep(delay)
                    status, headers, text = answer(body)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1
                reply = ({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": text}}],
                          "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
                         if status == 200 else text if isinstance(text, dict) else {"error": {"message": text}})
                data = json.dumps(reply).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
