"""serve_rm's intake and scheduler in-process: the limit-checking JSON reader against json.loads, body reading
(size, timeout, disconnect), and the round-robin micro-batcher (fairness, cancellation, rejections)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest

from rlhfkit.serving.batcher import FairBatcher, Rejected
from rlhfkit.serving.request import (VALUES_PER_QUERY, ClientGone, RequestError, RequestLimits,
                                          parse_or_error, parse_request, read_body)

LIMITS = RequestLimits(max_queries=100, max_query_chars=50, max_json_depth=6)


def _random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth < 3 and r < 0.2:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 3 and r < 0.35:
        return {rng.choice(["a", "é", '"', "\\", ""]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.choice([None, True, False, 0, -17, 1.5e-7, 2 ** 70, "x", "é\n\"\\\U0001F600", ""])


def _valid_request(ref) -> bool:
    """What parse_request must accept: the protocol's shape (json.loads accepted the JSON already)."""
    if not isinstance(ref, dict) or not isinstance(ref.get("query"), list):
        return False
    n = len(ref["query"])
    texts_ok = all(isinstance(q, str) and q and not any(0xD800 <= ord(c) <= 0xDFFF for c in q) for q in ref["query"])
    return texts_ok and all(ref.get(k) is None or (isinstance(ref[k], list) and len(ref[k]) in (0, n))
                            for k in ("prompts", "labels"))


def test_reader_agrees_with_json_loads():
    """Random requests, half of them with one character changed: whatever json.loads reads as a valid
    request the reader returns equal; everything else is a 400."""
    rng = random.Random(0)
    accepted = rejected = 0
    for _ in range(3000):
        doc = {"query": [rng.choice(["ab", "é\u2028", "\U0001F600 x", 'a"b\\c']) for _ in range(rng.randint(0, 3))]}
        if rng.random() < 0.5:
            doc["labels"] = [_random_value(rng) for _ in doc["query"]]
        if rng.random() < 0.3:
            doc["other"] = _random_value(rng)
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        if rng.random() < 0.5:
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice(["", ",", "]", "}", "[", "{", '"', " ", ":", "1", "\\", "nul"]) + text[i + 1:]
        try:
            ref = json.loads(text)
        except ValueError:
            ref = None
        body = text.encode("utf-8", "surrogatepass")
        if ref is not None and _valid_request(ref):
            got = parse_request(body, RequestLimits())
            assert (got.query, got.labels) == (ref["query"], ref.get("labels")), text
            accepted += 1
        else:
            with pytest.raises(RequestError) as e:
                parse_request(body, RequestLimits())
            assert e.value.status == (422 if "is empty" in str(e.value) else 400), (text, str(e.value))
            rejected += 1
    assert accepted > 1000 and rejected > 1000


@pytest.mark.parametrize("body, status, message", [
    ('{"query": ["' + "x" * 51 + '"]}', 422, "query[0] has 51 characters, more than --max_query_chars (50)"),
    (json.dumps({"query": ["a"] * 101}), 422, "'query' holds a list or object of more than --max_queries (100)"),
    (json.dumps({"query": ["a"], "labels": [[1] * 100] * 9}), 422,
     f"more than {VALUES_PER_QUERY} x --max_queries ({VALUES_PER_QUERY * 100}) JSON values"),
    ('{"query": ["a"], "labels": [[[[[["deep"]]]]]]}', 422, "nested deeper than --max_json_depth (6)"),
    ('{"query": ["a"], "x": ' + "[" * 200_000, 422, "nested deeper than --max_json_depth (6)"),
    ('{"query": [""]}', 422, "query[0] is empty"),
    ('{"query": ["ok", "\\ud800"]}', 400, "query[1] holds a lone surrogate \\ud800"),
    ('{"query": ["a\\udfffb"]}', 400, "lone surrogate \\udfff at character 1"),
    ('{"query": ["a"], "labels": [' + "1" * 5000 + "]}", 400, "malformed JSON"),
    ('{"query": ["a"], "query": ["b"]}', 400, "duplicate field 'query'"),
    ('{"query": ["a"]} x', 400, "extra data"),
    ('{"query": ["a\\x"]}', 400, "Invalid \\escape"),
    ('{"query": ["a\nb"]}', 400, "Invalid control character"),
    ('{"query": [null]}', 400, "query[0] is not a string"),
    ('{"query": {"a": 1}}', 400, "'query' must be a list of strings"),
    ('{"query": ["a"], "prompts": "p"}', 400, "'prompts' must be a list"),
    ('{"query": ["a"], "labels": [1, 2]}', 400, "'labels' has 2 entries for 1 queries"),
    ("", 400, "got an empty body"),
    ("null", 400, "must be a JSON object"),
    ('\ufeff{"query": ["a"]}', 400, "must be a JSON object"),
    ('{"query": ["a"], "labels": [1,]}', 400, "malformed JSON: expected a value"),
    ('{"query" ["a"]}', 400, "malformed JSON: expected ':'"),
])
def test_limits_and_malformed_bodies(body, status, message):
    with pytest.raises(RequestError) as e:
        parse_request(body.encode("utf-8"), LIMITS)
    assert e.value.status == status and message in str(e.value), str(e.value)


def test_invalid_utf8_and_error_without_traceback():
    for raw in (b"\xff", b'{"query": ["\xed\xa0\x80"]}', b'{"query": ["\xc3"]}'):  # \xed\xa0\x80: a UTF-8 surrogate
        with pytest.raises(RequestError, match="not valid UTF-8"):
            parse_request(raw, LIMITS)
    err = parse_or_error(b'{"query": [1]}', LIMITS)
    assert isinstance(err, RequestError) and err.status == 400 and err.__traceback__ is None
    ok = parse_or_error(b'{"query": ["a"], "prompts": [], "labels": [{"x": [1, 2.5, null]}]}', LIMITS)
    assert (ok.query, ok.prompts, ok.labels) == (["a"], [], [{"x": [1, 2.5, None]}])


def _receiver(chunks: list[bytes], delay_s: float = 0.0, then_disconnect: bool = False):
    async def receive() -> dict:
        await asyncio.sleep(delay_s)
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks) or then_disconnect}
        return {"type": "http.disconnect"}
    return receive


def test_read_body_limits_timeout_and_disconnect():
    limits = RequestLimits(max_body_bytes=10, read_timeout_s=0.3)
    run = asyncio.run
    assert run(read_body(_receiver([b"12345", b"678"]), "8", limits)) == b"12345678"
    with pytest.raises(RequestError, match="11 bytes exceeds --max_body_mb") as e:
        run(read_body(_receiver([b"x"]), "11", limits))  # refused from the header, before reading
    assert e.value.status == 413
    with pytest.raises(RequestError, match="exceeds --max_body_mb") as e:
        run(read_body(_receiver([b"123456", b"789012"]), None, limits))  # chunked: counted as it arrives
    assert e.value.status == 413
    with pytest.raises(RequestError, match=r"not received within --read_timeout_s \(0.3 s; \d bytes arrived\)") as e:
        run(read_body(_receiver([b"ab", b"cd"] + [b""] * 10, delay_s=0.1), None, limits))
    assert e.value.status == 408
    with pytest.raises(ClientGone):
        run(read_body(_receiver([b"ab"], then_disconnect=True), None, limits))


# ----------------------------------------------------------------------------- scheduler


def _scorer(log: list[list], gate: threading.Event | None = None):
    """Scores len(item); "bad" is rejected, "boom" raises; the first forward waits for `gate`."""
    def score(items: list) -> list:
        log.append(list(items))
        if gate is not None and len(log) == 1:
            assert gate.wait(10)
        if "boom" in items:
            raise RuntimeError("model exploded")
        return [Rejected("is bad") if item == "bad" else float(len(item)) for item in items]
    return score


def test_round_robin_serves_a_small_request_behind_a_large_one():
    log: list[list] = []
    gate = threading.Event()

    async def run():
        b = FairBatcher(_scorer(log, gate), batch_size=4, wait_s=0.0)
        task = asyncio.create_task(b.run())
        big = asyncio.ensure_future(b.submit(["a" * (i % 3 + 1) for i in range(40)]))
        await asyncio.sleep(0.05)  # the first forward (big's items 0-3) is running
        small = asyncio.ensure_future(b.submit(["xy", "z"]))
        await asyncio.sleep(0.01)
        gate.set()
        small_out = await small
        forwards_when_small_done = b.forwards
        out = await big
        task.cancel()
        return small_out, forwards_when_small_done, out, b

    small, at, big, b = asyncio.run(run())
    assert small == [2.0, 1.0] and big == [float(i % 3 + 1) for i in range(40)]
    assert at == 2  # the forward after the running one, not after the 10 the big request needs
    assert log[1] == ["aa", "xy", "aaa", "z"]  # alternating: big, small, big, small
    assert b.sequences == 42 and b.forwards == 11 and all(len(f) <= 4 for f in log)


def test_concurrent_small_requests_share_forwards_and_lone_client_does_not_wait():
    log: list[list] = []

    async def run():
        b = FairBatcher(_scorer(log), batch_size=8, wait_s=5.0)
        task = asyncio.create_task(b.run())
        outs = await asyncio.gather(*[b.submit(["q" * k]) for k in range(1, 17)])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        lone = await b.submit(["abc"])  # nothing announced: no wait for more
        waited = loop.time() - t0
        task.cancel()
        return outs, lone, waited

    outs, lone, waited = asyncio.run(run())
    assert outs == [[float(k)] for k in range(1, 17)] and lone == [3.0] and waited < 2.0
    assert [len(f) for f in log] == [8, 8, 1]


def test_batcher_waits_only_for_announced_requests():
    log: list[list] = []

    async def run(announce_late: bool) -> float:
        b = FairBatcher(_scorer(log), batch_size=4, wait_s=2.0)
        task = asyncio.create_task(b.run())

        async def late():
            if announce_late:
                with b.announce():  # being read: the batcher may wait for it
                    await asyncio.sleep(0.05)
            else:
                await asyncio.sleep(0.05)
            return await b.submit(["bb"])

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await asyncio.gather(b.submit(["a"]), late()) == [[1.0], [2.0]]
        task.cancel()
        return loop.time() - t0

    assert asyncio.run(run(True)) < 1.0 and log == [["a", "bb"]]  # waited ~50 ms: one forward of 2
    log.clear()
    assert asyncio.run(run(False)) < 1.0 and log == [["a"], ["bb"]]  # nothing announced: no wait


def test_cancel_drops_unscheduled_items_and_rejections_fail_one_request():
    log: list[list] = []
    gate = threading.Event()

    async def run():
        b = FairBatcher(_scorer(log, gate), batch_size=2, wait_s=0.0)
        task = asyncio.create_task(b.run())
        doomed = asyncio.ensure_future(b.submit(["d"] * 100))
        await asyncio.sleep(0.05)  # its first forward is running
        doomed.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.sleep(0.05)
        counts = (b.cancelled, b.dropped, b.sequences)
        results = await asyncio.gather(b.submit(["ok", "bad", "x", "y"]), b.submit(["fine"]),
                                       return_exceptions=True)
        failed = await asyncio.gather(b.submit(["boom"]), return_exceptions=True)
        after = await b.submit(["again"])
        task.cancel()
        return counts, results, failed[0], after, b

    counts, (rejected, fine), failed, after, b = asyncio.run(run())
    assert counts == (1, 98, 2) and log[0] == ["d", "d"]  # 1 request cancelled, 98 items dropped, 2 scored
    assert not any("d" in f for f in log[1:])  # nothing of the cancelled request after its running forward
    assert isinstance(rejected, RequestError) and rejected.status == 422 and str(rejected) == "query[1] is bad"
    assert fine == [4.0] and after == [5.0]
    assert isinstance(failed, RequestError) and failed.status == 500 and "model exploded" in str(failed)
    assert all("y" not in f for f in log) and b.dropped == 99  # the rejected request's last item: dropped
