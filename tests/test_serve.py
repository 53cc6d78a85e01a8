"""`longsft serve` as the `openai` SDK uses it (chat and completions, whole and streamed), and under a bounded
abuse test on loopback: oversized and malformed bodies, stalled and slow connections, a full queue, a huge
max_tokens beside small requests, keys, bad settings and a port in use; real tiny model."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from conftest import run_cli

from longsft.eval.serve import ServeConfig, build

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def backend(model):
    from longsft.eval.backends import HFBackend
    from longsft.eval.eval_config import EvalConfig, model_config

    return HFBackend(model_config(EvalConfig(model=str(model), tokenizer="qwen")), 8)


@contextmanager
def running(backend, model, **keys):
    """A server on a free loopback port, dispatching on a thread, over the module's loaded model."""
    cfg = ServeConfig(**{"model": str(model), "tokenizer": "qwen", "port": 0, "max_new_tokens": 32, "timeout": 2.0,
                         **keys})
    server = build(cfg, backend)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def call(server, method="POST", path=CHAT, body=HI, headers=None, timeout=30.0) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=timeout)
    try:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        c.request(method, path, body=data, headers=headers or {})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def raw(server, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and read the answer to its end."""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # and nothing more
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(1 << 16):
        out += chunk
    return out


def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_chat_takes_the_whole_conversation_temperature_and_seed(backend, model):
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Blue."}, {"role": "user", "content": [{"type": "text", "text": "And?"}]}]
    flat = [dict(m, content="And?") if isinstance(m["content"], list) else m for m in convo]
    expected = len(backend.tok.apply_chat_template(flat, add_generation_prompt=True, tokenize=True, return_dict=False,
                                                   enable_thinking=False))
    with running(backend, model) as server:
        status, listing = call(server, "GET", "/v1/models", None)
        assert status == 200 and [m["id"] for m in listing["data"]] == [model.name]  # the folder, not its path
        status, r = call(server, body={"messages": convo, "max_tokens": 5})
        assert status == 200 and r["model"] == model.name and r["usage"]["prompt_tokens"] == expected
        n, finish = r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]
        assert n <= 5 and finish == ("length" if n == 5 else "stop")  # cut at max_tokens, or it ended itself

        def text(**kw):
            status, r = call(server, body={"messages": convo, "max_tokens": 8, **kw})
            assert status == 200, r
            return r["choices"][0]["message"]["content"]

        assert text() == text(temperature=0)  # the default (temperature=0): greedy
        assert text(temperature=1.5, seed=1) == text(temperature=1.5, seed=1)
        assert len({text(temperature=1.5, seed=s) for s in range(3)}) > 1  # sampled; a random model, 151k tokens
    with running(backend, model, served_model_name="tiny-qwen") as server:
        assert call(server, "GET", "/v1/models", None)[1]["data"][0]["id"] == "tiny-qwen"


MALFORMED = [b"not json", b"\xff\xfe\x00garbage", b"[1, 2]", b'"hi"', b"{}", b'{"messages": "hi"}',
             b'{"messages": []}', b'{"messages": [{"role": "user"}]}',
             b'{"messages": [{"role": "robot", "content": "x"}]}',
             b'{"messages": ["hi"]}', b'{"messages": [{"role": "user", "content": {"a": 1}}]}',
             b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
             *(json.dumps(dict(HI, **kw)).encode() for kw in [
                 {"max_tokens": "abc"}, {"max_tokens": 0}, {"max_tokens": -5}, {"max_tokens": 2.5},
                 {"max_tokens": True}, {"max_completion_tokens": "x"}, {"temperature": "hot"}, {"temperature": -1},
                 {"temperature": 9}, {"top_p": 0}, {"top_p": 2}, {"seed": -1}, {"seed": "s"}, {"stream": "yes"},
                 {"n": 3}, {"stop": ["\n"]}, {"tools": [{"type": "function"}]}]),
             b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
             b"[" * 100_000]


def test_every_malformed_request_gets_a_json_error_and_the_server_keeps_answering(backend, model):
    with running(backend, model) as server:
        for body in MALFORMED:
            status, r = call(server, body=body, headers={"Content-Type": "application/json"})
            assert status == 400 and r["error"]["type"] == "invalid_request_error" and r["error"]["message"], body
        assert call(server, "POST", "/v1/nope")[0] == 404
        assert call(server, "GET", "/v2/models", None)[0] == 404
        status, r = call(server, "DELETE", CHAT, None)
        assert status == 405 and r["error"]["code"] == "method_not_allowed"
        for bad in [b"GARBAGE\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: ten\r\n\r\n",
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{}"]:  # short, EOF
            head, _, body = raw(server, bad).partition(b"\r\n\r\n")
            assert head.split()[1] == b"400" and "error" in json.loads(body), (bad, head, body)
        assert call(server)[0] == 200


def test_oversized_body_is_refused_before_it_is_read(backend, model):
    with running(backend, model, max_body_bytes=4096) as server:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300000000\r\n\r\n"
                      + b"x" * 65536)  # 300 MB announced, 64 KiB sent, then nothing
            answer = read_all(s)
            assert answer.startswith(b"HTTP/1.1 413") and b"max_body_bytes" in answer
            assert time.monotonic() - t0 < 4  # answered, not waiting for 300 MB
        expect = raw(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                             b"Content-Length: 300000000\r\n\r\n")
        assert expect.startswith(b"HTTP/1.1 413")  # refused before the client sends the body at all
        status, r = call(server, body=b"{" + b" " * 1_000_000 + b"}")  # a real client sending 1 MB reads the 413
        assert status == 413 and "4096" in r["error"]["message"]
        assert call(server)[0] == 200


def test_stalled_and_slow_connections_hold_no_threads_and_are_dropped(backend, model):
    with running(backend, model, timeout=1.0, max_pending=40) as server:
        assert call(server)[0] == 200  # the model's thread exists from the first request on
        threads = threading.active_count()
        addr = ("127.0.0.1", server.server_address[1])
        stalled = [socket.create_connection(addr, timeout=5) for _ in range(60)]  # connect, never send
        slow = [socket.create_connection(addr, timeout=5) for _ in range(2)]  # a request line, then nothing
        for s in slow:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
        t0 = time.monotonic()
        assert call(server, timeout=10)[0] == 200  # answered beside them at once
        assert time.monotonic() - t0 < 3
        assert threading.active_count() == threads  # 62 open connections, not one thread more
        t0 = time.monotonic()
        for s in stalled + slow:  # every one closed by the server within about one timeout
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
            s.close()
        assert time.monotonic() - t0 < 4
        assert call(server)[0] == 200


def test_requests_beyond_the_queue_get_503_and_the_queue_drains(backend, model, monkeypatch):
    """One request generates (held here), ``max_queue`` wait behind it, the next is refused at once."""
    release, started = threading.Event(), threading.Event()
    real = backend.generate_ids

    def held(*a, **k):
        started.set()
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(backend, "generate_ids", held)
    with running(backend, model, max_queue=1) as server:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(call, server)
            assert started.wait(10)
            queued = pool.submit(call, server)
            until(lambda: server.app.model.admitted == 2)
            t0 = time.monotonic()
            status, r = call(server)
            assert status == 503 and r["error"]["type"] == "server_error" and time.monotonic() - t0 < 1
            release.set()
            assert first.result()[0] == 200 and queued.result()[0] == 200
        assert server.app.model.admitted == 0 and call(server)[0] == 200


def test_batch_generates_waiting_greedy_requests_together_with_their_own_replies(tiny_model_dir, monkeypatch):
    """``batch=3``: while one request generates (held here), three greedy requests and a sampled one queue;
    the three then go as one batch (the sampled one alone), and each reply is the one it gets unbatched,
    cut at its own max_tokens (a model whose replies depend on the prompt: rows cannot be swapped unseen)."""
    from longsft.eval.backends import HFBackend
    from longsft.eval.eval_config import EvalConfig, model_config

    model = tiny_model_dir("qwen3", init=0.5)
    backend = HFBackend(model_config(EvalConfig(model=str(model), tokenizer="qwen")), 8)
    asks = [{"messages": [{"role": "user", "content": f"story {i}" * (i + 1)}], "max_tokens": n}
            for i, n in enumerate((6, 3, 8))]
    with running(backend, model) as server:
        alone = [call(server, body=b)[1] for b in asks]
    texts = [a["choices"][0]["message"]["content"] for a in alone]
    assert len(set(texts)) == 3 and all(texts), texts
    release, started, batches = threading.Event(), threading.Event(), []
    real_one, real_batch = backend.generate_ids, backend.generate_batch

    def held(*a, **k):
        if not started.is_set():
            started.set()
            release.wait(30)
        return real_one(*a, **k)

    def batch(prompts, max_tokens):
        batches.append(list(max_tokens))
        return real_batch(prompts, max_tokens)

    monkeypatch.setattr(backend, "generate_ids", held)
    monkeypatch.setattr(backend, "generate_batch", batch)
    with running(backend, model, batch=3) as server:
        with ThreadPoolExecutor(5) as pool:
            first = pool.submit(call, server, body={**HI, "temperature": 0.5, "seed": 1})  # holds the model
            assert started.wait(10)
            got = [pool.submit(call, server, body=b) for b in asks]
            sampled = pool.submit(call, server, body={**HI, "temperature": 0.7, "seed": 2})
            until(lambda: server.app.model.admitted == 5)
            release.set()
            got = [f.result() for f in got]
            assert first.result()[0] == 200 and sampled.result()[0] == 200
    assert len(batches) == 1 and sorted(batches[0]) == [3, 6, 8]  # (in arrival order)
    for (status, r), want in zip(got, alone):
        assert status == 200 and r["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert r["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
        assert r["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]


def test_the_openai_sdk_gets_chat_and_completions_whole_and_streamed(backend, model):
    """What clients use: models, chat and completions through the real ``openai`` SDK, ``stream=True`` giving
    the same text as the whole reply (greedy), the usage chunk when asked, and a stream left early stops."""
    import openai

    with running(backend, model, max_new_tokens=24) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == [model.name]
        messages = [{"role": "user", "content": "Name a colour."}]
        whole = client.chat.completions.create(model="x", messages=messages, max_tokens=12)
        text = whole.choices[0].message.content
        assert whole.object == "chat.completion" and whole.usage.completion_tokens <= 12 and text
        chunks = list(client.chat.completions.create(model="x", messages=messages, max_tokens=12, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant" and all(c.object == "chat.completion.chunk" for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
        done = client.completions.create(model="x", prompt="Once upon a time", max_tokens=10)
        assert done.object == "text_completion" and done.usage.completion_tokens <= 10
        streamed = list(client.completions.create(model="x", prompt="Once upon a time", max_tokens=10, stream=True))
        assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
        with pytest.raises(openai.BadRequestError, match="max_new_tokens"):
            client.completions.create(model="x", prompt="hi", max_tokens=25, stream=True)
        stream = client.chat.completions.create(model="x", messages=messages, max_tokens=24, stream=True)
        next(iter(stream))
        stream.close()  # the client leaves: the generation stops, the model is free again
        until(lambda: server.app.model.admitted == 0)
        assert client.chat.completions.create(model="x", messages=messages, max_tokens=2).choices


def test_huge_max_tokens_is_refused_and_a_full_one_does_not_starve_small_ones(backend, model):
    big = {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 64}
    with running(backend, model, max_new_tokens=64) as server:
        t0 = time.monotonic()
        status, r = call(server, body=dict(big, max_tokens=10 ** 9))
        assert status == 400 and "max_new_tokens" in r["error"]["message"] and time.monotonic() - t0 < 1
        t0 = time.monotonic()
        assert call(server, body=big)[1]["usage"]["completion_tokens"] == 64  # a random model runs to the cap
        one_big = time.monotonic() - t0
        with ThreadPoolExecutor(8) as pool:
            bigs = [pool.submit(call, server, body=big) for _ in range(3)]
            time.sleep(0.05)
            t0 = time.monotonic()
            small = [pool.submit(call, server) for _ in range(4)]
            assert all(f.result()[0] == 200 for f in small)
            # in arrival order: a small request waits for the (capped) requests ahead of it, no more
            assert time.monotonic() - t0 < 3 * one_big + 3
            assert all(f.result()[0] == 200 for f in bigs)


def test_exposed_host_warns_and_takes_a_key(backend, model, capsys, monkeypatch):
    monkeypatch.delenv("LONGSFT_API_KEY", raising=False)
    with running(backend, model, host="0.0.0.0"):
        assert "warning: 0.0.0.0 is reachable from other machines; there is no API key" in capsys.readouterr().err
    with running(backend, model, host="127.0.0.1"):
        assert "warning" not in capsys.readouterr().err
    monkeypatch.setenv("LONGSFT_API_KEY", "from-env")
    for keys, key in [({"host": "0.0.0.0", "api_key": "s3cret"}, "s3cret"), ({}, "from-env")]:
        with running(backend, model, **keys) as server:
            for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": key}]:
                status, r = call(server, "GET", "/v1/models", None, headers)
                assert status == 401 and r["error"]["code"] == "invalid_api_key"
                assert call(server, headers=headers)[0] == 401
            assert call(server, "GET", "/health", None)[0] == 200
            assert call(server, "GET", "/v1/models", None, {"Authorization": f"Bearer {key}"})[0] == 200
            assert call(server, headers={"Authorization": f"Bearer {key}"})[0] == 200


def test_port_in_use_exits_2_before_the_model_loads(model, capsys, monkeypatch):
    from longsft.eval import backends

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(backends.HFBackend, "__init__", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run_cli(capsys, "serve", f"model={model}", "tokenizer=qwen", f"port={port}")
    assert code == 2 and err.strip() == f"longsft: port {port} on 127.0.0.1 is already in use (another server?); " \
                                        "choose another with port="


@pytest.mark.parametrize("arg, says", [("port=70000", "port=70000"), ("port=-1", "port=-1"),
                                       ("max_body_bytes=-1", "max_body_bytes"), ("max_new_tokens=0", "max_new_tokens"),
                                       ("timeout=0", "timeout"),
                                       ("max_queue=-3", "max_queue"),
                                       ("max_pending=0", "max_pending"), ("temperature=3", "temperature"),
                                       ("batch=0", "batch"),
                                       ("dtype=fp16", "dtype"), ("api_key=", "api_key"), ("portt=1", "port"),
                                       ("host=no.such.host.invalid", "host=no.such.host.invalid")])
def test_bad_settings_are_one_line_errors(arg, says, model, capsys):
    code, out, err = run_cli(capsys, "serve", f"model={model}", "tokenizer=qwen", "port=0", arg)
    assert code == 2 and err.startswith("longsft: ") and says in err and len(err.strip().splitlines()) == 1, err


def test_model_is_required(capsys):
    code, _, err = run_cli(capsys, "serve", "port=0")
    assert code == 2 and "model= is required" in err


def test_a_batched_request_gets_its_reply_when_the_request_holding_the_model_is_cancelled():
    """batch=2, two greedy requests queued together; the one holding the model is cancelled while their
    batch runs: the other still gets its reply when the batch ends (no hang, no second generation). And a
    request behind queued entries whose requests are gone generates theirs, then its own."""
    import asyncio

    from longsft.eval.backends import Generation
    from longsft.eval.serve import ModelQueue

    class Echo:  # a reply is its prompt's first id, as text; a batch waits for ``go``
        def __init__(self):
            self.batches, self.go = [], threading.Event()

        def generate_batch(self, prompts, max_tokens):
            self.batches.append([p[0] for p in prompts])
            self.go.wait(10)
            return [Generation(str(p[0]), len(p), 1, 0.0) for p in prompts]

    async def cancelled_holder():
        q = ModelQueue(Echo(), max_queue=8, batch=2)
        a, b = asyncio.ensure_future(q.greedy([1], 4)), asyncio.ensure_future(q.greedy([2], 4))
        while not q.backend.batches:
            await asyncio.sleep(0.01)
        a.cancel()
        await asyncio.sleep(0.05)
        q.backend.go.set()
        return (await asyncio.wait_for(b, 10)).text, q.backend.batches, a.cancelled()

    assert asyncio.run(cancelled_holder()) == ("2", [[1, 2]], True)

    async def behind_departed():
        q = ModelQueue(Echo(), max_queue=8, batch=2)
        q.backend.go.set()
        loop = asyncio.get_running_loop()
        q.waiting += [([1], 4, loop.create_future()), ([2], 4, loop.create_future())]  # their clients went away
        return (await q.greedy([3], 4)).text, q.backend.batches

    assert asyncio.run(behind_departed()) == ("3", [[1, 2], [3]])
