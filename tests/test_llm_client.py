"""The one LLM client (openai SDK) against a real local HTTP server: Retry-After honoured, retries printed,
refusals at once, one kept-alive connection; the re-ask helper; the one append-only cache and JSONL reader."""

import pytest
from llm_server import Server

from longsft.train.common.cache import AppendCache
from longsft.train.common.errors import DataError
from longsft.train.common.io import JsonlLog, iter_jsonl
from longsft.train.common.llm import Endpoint, EndpointError, LLMError, ask_json, reask_json


def scripted(entries):
    """An endpoint answering from a script: each (status, headers, reply text) serves one request, then
    ``{"ok": true}``."""
    script = list(entries)
    return Server(lambda body: script.pop(0) if script else (200, {}, '{"ok": true}'))


@pytest.fixture
def script():
    made = []

    def make(*entries):
        made.append(scripted(entries))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_retry_after_is_honoured_and_each_retry_printed(script, capsys):
    s = script((429, {"Retry-After": "2"}, "slow down"), (503, {}, "busy"), (200, {}, "hello"))
    r = Endpoint("m", s.url).chat([{"role": "user", "content": "hi"}])
    assert (r.text, r.prompt_tokens, r.completion_tokens, r.finish_reason) == ("hello", 3, 2, "stop")
    (t0, *_), (t1, *_), (t2, *_) = s.seen
    assert t1 - t0 >= 2.0  # the server's Retry-After, not the SDK's own first backoff (<= 0.5 s)
    assert t2 - t1 < 1.6  # no Retry-After: the SDK's second backoff, 1 s less up to 25% jitter
    err = capsys.readouterr().err.splitlines()
    assert err == [f"longsft: m@{s.url}: HTTP 429, Retry-After 2 s; retry 1/2",
                   f"longsft: m@{s.url}: HTTP 503; retry 2/2"]


def test_refusals_fail_at_once_and_retries_run_out_with_the_reason(script, capsys):
    s = script((404, {}, "model 'm' not found"))
    with pytest.raises(EndpointError, match=r"m@\S+: HTTP 404: model 'm' not found; wrong model name, key or URL\?"):
        Endpoint("m", s.url).chat([{"role": "user", "content": "hi"}])
    s2 = script((404, {}, {"detail": "Not Found"}))  # a server's own error shape: its body is shown
    with pytest.raises(EndpointError, match=r"HTTP 404: \{\"detail\": \"Not Found\"\}; wrong model name"):
        Endpoint("m", s2.url).chat([{"role": "user", "content": "hi"}])
    assert len(s.seen) == len(s2.seen) == 1 and not capsys.readouterr().err
    s = script(*[(501, {"Retry-After": "0"}, "not here")] * 2)  # any 5xx is retried, and said so
    with pytest.raises(EndpointError, match=r"no answer after 2 requests \(HTTP 501: not here\)"):
        Endpoint("m", s.url, retries=1).chat([{"role": "user", "content": "hi"}])
    s = script((429, {"Retry-After": "300"}, "come back later"))  # longer than the SDK waits: not retried
    with pytest.raises(EndpointError, match=r"no answer after 1 request \(HTTP 429: come back later; it asked to "
                                            r"wait 300 s, longer than the client waits"):
        Endpoint("m", s.url).chat([{"role": "user", "content": "hi"}])
    assert len(s.seen) == 1


def test_one_endpoint_keeps_one_connection(script):
    s = script()
    ep = Endpoint("m", s.url)
    for _ in range(3):
        ep.chat([{"role": "user", "content": "hi"}])
    assert len({port for _, port, _ in s.seen}) == 1  # urllib opened a connection per request


def test_reask_sends_the_complaint_back_as_the_next_turn(script, tmp_path):
    s = script((200, {}, "Sure, here it is"), (200, {}, '{"score": 9}'), (200, {}, '```json\n{"score": 3}\n```'))

    def valid(obj):
        return None if obj.get("score") in range(6) else "score must be 0..5"

    cache = AppendCache(tmp_path / "answers.jsonl")
    ep = Endpoint("m", s.url)
    assert ask_json(ep, "Rate it.", valid, retries=2, cache=cache) == {"score": 3}
    last = s.seen[-1][2]["messages"]
    assert [m["role"] for m in last] == ["user", "assistant", "user"]
    assert last[1]["content"] == '{"score": 9}' and "Invalid answer: score must be 0..5" in last[2]["content"]
    assert "no JSON object in the reply" in s.seen[1][2]["messages"][2]["content"]
    # cached: the same question is not asked again, also by a new process reading the file
    assert ask_json(ep, "Rate it.", valid, cache=AppendCache(tmp_path / "answers.jsonl")) == {"score": 3}
    assert len(s.seen) == 3
    obj, complaints = reask_json(lambda messages: "nothing", "q", valid, retries=1)
    assert obj is None and complaints == ["no JSON object in the reply"] * 2
    s2 = script(*[(200, {}, "no")] * 2)
    with pytest.raises(LLMError, match="m: no valid answer after 2 tries"):
        ask_json(Endpoint("m", s2.url), "Rate it.", valid, retries=1)


def test_cache_survives_a_cut_off_line_and_keeps_failures_for_the_report(tmp_path):
    path = tmp_path / "c.jsonl"
    c = AppendCache(path)
    c.put({"key": "a", "prediction": "", "error": "timeout"})
    c.put({"key": "b", "prediction": "ok", "error": None})
    c.close()
    with path.open("a") as f:
        f.write('{"key": "a", "predic')  # a crash in mid-line
    c = AppendCache(path)
    assert c.get("a") is None and c.latest("a")["error"] == "timeout" and c.get("b")["prediction"] == "ok"
    c.put({"key": "a", "prediction": "late", "error": None})
    c.close()
    c = AppendCache(path)
    assert c.get("a")["prediction"] == "late"  # the record after the cut-off line is a line of its own
    assert len(path.read_text().splitlines()) == 4
    assert not AppendCache(tmp_path / "none.jsonl").added and not (tmp_path / "none.jsonl").exists()


def test_one_jsonl_reader_strict_for_data_lenient_for_logs(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n[1, 2]\n{"b": \xff}\n{"c": 3}\n{"cut')
    with pytest.raises(DataError, match=rf"{path}:3: expected a JSON object, got list"):
        list(iter_jsonl(path))
    assert list(iter_jsonl(path, log=True)) == [(1, {"a": 1}), (5, {"c": 3})]
    assert list(iter_jsonl(tmp_path / "missing.jsonl", log=True)) == []
    with pytest.raises(DataError, match="file not found"):
        list(iter_jsonl(tmp_path / "missing.jsonl"))
    log = JsonlLog(path)
    log.write({"d": 4})
    log.close()
    assert list(iter_jsonl(path, log=True))[-1] == (7, {"d": 4})


def test_endpoint_options_reach_the_server_and_key_the_cache(tmp_path):
    """``MODEL@URL#temperature=T,seed=S``: the options are sent with each request, shown in the endpoint's
    name and part of its cache key (two judges on one served model keep apart answers), while a greedy
    endpoint keeps the key it always had; a bad option is refused naming it. An MMA judge that gives no
    score is asked again with the complaint, and each judge's answer is its own."""
    from longsft.train.common.llm import answer_key
    from longsft.train.datagen.mma import ask_judgement

    def answer(body):  # no score at first; once told, a score that depends on how it was asked
        told = len(body["messages"]) == 3 and "no score in the reply" in body["messages"][2]["content"]
        return 200, {}, (f'{{"score": {1 if body["temperature"] else 4}, "reason": "r"}}' if told else "Hmm.")

    s = Server(answer)
    try:
        greedy, sampled = Endpoint.parse(f"m@{s.url}"), Endpoint.parse(f"m@{s.url}#temperature=0.7,seed=3")
        assert (sampled.temperature, sampled.seed, str(sampled)) == (0.7, 3, f"m@{s.url}#temperature=0.7,seed=3")
        assert greedy.cache_key("p") == answer_key("m", s.url, "p") != sampled.cache_key("p")
        seed0 = Endpoint.parse(f"m@{s.url}#temperature=0.7,seed=0")  # seed 0 is a seed
        assert str(seed0).endswith("seed=0") and seed0.cache_key("p") != Endpoint.parse(
            f"m@{s.url}#temperature=0.7").cache_key("p")
        cache = AppendCache(str(tmp_path / "c.jsonl"))
        assert ask_judgement(greedy, "Summary:\nx", 1, cache)["score"] == 4
        assert ask_judgement(sampled, "Summary:\nx", 1, cache)["score"] == 1
        bodies = [body for _, _, body in s.seen]
        assert [("seed" in b, b["temperature"]) for b in bodies] == [(False, 0.0)] * 2 + [(True, 0.7)] * 2
        assert bodies[3]["seed"] == 3 and bodies[3]["messages"][1] == {"role": "assistant", "content": "Hmm."}
        assert ask_judgement(sampled, "Summary:\nx", 1, cache)["score"] == 1 and len(s.seen) == 4  # cached
    finally:
        s.close()
    for spec, why in [("m@http://h/v1#temp=1", "unknown option 'temp=1'"),
                      ("m@http://h/v1#temperature=3", "temperature must be a number in"),
                      ("m@http://h/v1#seed=x", "seed must be an integer")]:
        with pytest.raises(ValueError, match=why):
            Endpoint.parse(spec)
