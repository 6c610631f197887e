"""serve_rm's request intake: read and parse a /get_reward body under limits, before any tokenization.

    bytes --(--read_timeout_s, --max_body_mb: 408 / 413)--> UTF-8 text --(parse_request)--> RewardRequest

| limit                    | flag                | answer |
| ------------------------ | ------------------- | ------ |
| body bytes               | --max_body_mb       | 413    |
| items in a list          | --max_queries       | 422    |
| JSON values in all       | 8 x --max_queries   | 422    |
| characters of one query  | --max_query_chars   | 422    |
| nesting depth            | --max_json_depth    | 422    |
| time to send the headers | --read_timeout_s    | connection closed (header_timeout_protocol) |
| time to send the body    | --read_timeout_s    | 408, connection closed |

An oversized body is read through (and dropped) before its 413, so that a client sending it all before
reading gets the answer rather than a reset (`read_body`). Input that is not HTTP at all gets a JSON 400
too (`header_timeout_protocol`): every error body is JSON.

Anything else that is not a valid request (invalid UTF-8, malformed JSON, lone surrogates, wrong types,
integers too long for Python) is a 400. No input reaches the tokenizer or the model before passing here.

Parsing. `json.loads` would build the whole document first and check it afterwards (a body of 32 MB of
`"ab",` is 6 million string objects, and nesting deeper than Python's recursion limit raises
RecursionError). The body is therefore parsed by a small recursive-descent reader that checks each limit
when it reaches it: the `query` list item by item (strings scanned by json's C `scanstring`, each checked
for length and lone surrogates as it is read, the count checked as it grows), containers with their depth
and length, and scalars by json's C scanner. Nothing larger than the body's own text is ever built,
and the values read are bounded (8 x --max_queries), so is the time spent.
"""

from __future__ import annotations

import asyncio
import json
import json.decoder
import json.scanner
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator

from rlhfkit.config.declare import declared_default, default_of
from rlhfkit.serving.flags import ServerFlags


class RequestError(Exception):
    """A client error: answered with `status` and a JSON {"error": message}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client disconnected before its request was complete."""


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = int(declared_default(ServerFlags, "max_body_mb") * 1024 * 1024)
    max_queries: int = default_of(ServerFlags, "max_queries")
    max_query_chars: int = 1 << 20
    max_json_depth: int = default_of(ServerFlags, "max_json_depth")
    read_timeout_s: float = default_of(ServerFlags, "read_timeout_s")

    def __post_init__(self) -> None:
        for flag, value in (("--max_body_mb", self.max_body_bytes), ("--max_queries", self.max_queries),
                            ("--max_query_chars", self.max_query_chars)):
            if value < 1:
                raise ValueError(f"{flag} must be positive, got {value}")
        if not 2 <= self.max_json_depth <= 256:  # 2: {"query": [...]}; 256: well inside the recursion limit
            raise ValueError(f"--max_json_depth must be in [2, 256], got {self.max_json_depth}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"--read_timeout_s must be > 0, got {self.read_timeout_s}")


@dataclass
class RewardRequest:
    """A validated /get_reward body; `prompts` and `labels` are None or as long as `query`."""

    query: list[str]
    prompts: list[Any] | None = None
    labels: list[Any] | None = None


# ----------------------------------------------------------------------------- body


def drain_cap(limit: int) -> int:
    """Bytes of an oversized body read through (and dropped) before its 413 is sent."""
    return max(2 * limit, 64 << 20)


async def read_body(receive: Callable[[], Awaitable[dict]], content_length: str | None,
                    limits: RequestLimits) -> bytearray:
    """The body from ASGI `receive`; RequestError 413 past --max_body_mb, 408 past --read_timeout_s;
    ClientGone if the client disconnects first.

    An oversized body is read to its end and dropped (up to `drain_cap` bytes, within --read_timeout_s)
    before the 413 goes out: a client that sends its whole body before reading the answer (most do)
    then gets the 413, where closing on unread data would reset the connection under it. A body
    declared larger than the cap is answered at once."""
    limit = limits.max_body_bytes
    declared = int(content_length) if content_length is not None and content_length.strip().isdigit() else None
    too_big = (f"request body of {declared} bytes exceeds --max_body_mb ({limit} bytes)"
               if declared is not None and declared > limit else None)
    if too_big and declared > drain_cap(limit):
        raise RequestError(413, too_big)
    body = bytearray()
    seen = 0

    async def read() -> None:
        nonlocal seen, too_big
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            seen += len(chunk)
            if too_big is None:
                body.extend(chunk)
                if len(body) > limit:
                    too_big = f"request body exceeds --max_body_mb ({limit} bytes)"
                    body.clear()
            if not message.get("more_body", False) or (too_big and seen > drain_cap(limit)):
                return

    try:
        await asyncio.wait_for(read(), limits.read_timeout_s)
    except asyncio.TimeoutError:
        if too_big:
            raise RequestError(413, too_big) from None
        raise RequestError(408, f"request body not received within --read_timeout_s "
                                f"({limits.read_timeout_s:g} s; {len(body)} bytes arrived)") from None
    if too_big:
        raise RequestError(413, too_big)
    return body


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks) closing a connection whose
    request headers have not all arrived `timeout_s` after it opened or after its previous response.
    uvicorn has no such timeout (its keep-alive timer stops at the first byte received), so a client
    sending half a request line or header block would hold its connection forever."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    if not callable(getattr(AutoHTTPProtocol, "on_response_complete", None)):  # uvicorn changed its internals
        logging.getLogger("rlhfkit.serve_rm").warning(
            "this uvicorn's HTTP protocol has no on_response_complete: no --read_timeout_s for request headers")
        return AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete  # no request in progress
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """Input that is not HTTP: a JSON error body like every other answer (uvicorn's is plain text)."""
            body = json.dumps({"error": f"malformed HTTP request: {msg}"}).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return HeaderTimeoutProtocol


# ----------------------------------------------------------------------------- JSON

# The reader spends about a microsecond per value: bounding values by the queries bounds a request's
# parse time (0.4 s at the default --max_queries) whatever the body holds. 8 leaves room for a prompt
# and a structured label per query.
VALUES_PER_QUERY = 8
_WS = re.compile(r"[ \t\n\r]*")
_SURROGATE = re.compile("[\ud800-\udfff]")
_scanstring = json.decoder.scanstring  # C version when available: (text, index after '"') -> (str, end)
_scan_scalar = json.scanner.make_scanner(json.JSONDecoder())  # numbers, true/false/null, NaN/Infinity


def parse_request(body: bytes | bytearray, limits: RequestLimits) -> RewardRequest:
    """Validate a /get_reward body -> RewardRequest; RequestError 400 when malformed, 422 past a limit."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    return _Reader(text, limits).document()


def parse_or_error(body: bytes | bytearray, limits: RequestLimits) -> RewardRequest | RequestError:
    """`parse_request` returning its RequestError instead of raising it: the error that comes back has no
    traceback, whose frames would keep the body and its text alive as long as the error lives."""
    try:
        return parse_request(body, limits)
    except RequestError as e:
        return RequestError(e.status, str(e))


class _Reader:
    """Recursive-descent JSON reader for one /get_reward document; `pos` indexes `text`."""

    def __init__(self, text: str, limits: RequestLimits) -> None:
        self.text, self.limits, self.pos = text, limits, 0
        self.values = 0  # list items and object members read so far

    # -- helpers
    def fail(self, what: str) -> RequestError:
        return RequestError(400, f"malformed JSON: {what} at character {self.pos}")

    def peek(self) -> str:
        self.pos = _WS.match(self.text, self.pos).end()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise self.fail(f"expected {char!r}")
        self.pos += 1

    def string(self) -> str:
        try:
            value, self.pos = _scanstring(self.text, self.pos + 1, True)
        except json.JSONDecodeError as e:
            raise RequestError(400, f"malformed JSON: {e.msg} at character {e.pos}") from None
        return value

    def deeper(self, depth: int) -> int:
        if depth + 1 > self.limits.max_json_depth:
            raise RequestError(422, f"JSON nested deeper than --max_json_depth ({self.limits.max_json_depth})")
        return depth + 1

    def items(self, name: str, close: str) -> Iterator[int]:
        """Yield the index of each item of a list / object whose opening bracket was just read, with
        `pos` on the item; the caller reads the item. At most --max_queries items."""
        if self.peek() == close:
            self.pos += 1
            return
        count = 0
        while True:
            if count == self.limits.max_queries:
                raise RequestError(422, f"'{name}' holds a list or object of more than --max_queries "
                                        f"({self.limits.max_queries}) items")
            self.values += 1
            if self.values > VALUES_PER_QUERY * self.limits.max_queries:
                raise RequestError(422, f"the request holds more than {VALUES_PER_QUERY} x --max_queries "
                                        f"({VALUES_PER_QUERY * self.limits.max_queries}) JSON values")
            yield count
            count += 1
            char = self.peek()
            self.pos += 1
            if char == close:
                return
            if char != ",":
                self.pos -= 1
                raise self.fail(f"expected ',' or {close!r}")

    # -- grammar
    def document(self) -> RewardRequest:
        if self.peek() != "{":
            kind = {"[": "a list", '"': "a string", "": "an empty body"}.get(self.peek(), repr(self.peek()))
            raise RequestError(400, f"the body must be a JSON object with 'query', got {kind}")
        self.pos += 1
        fields: dict[str, Any] = {}
        for _ in self.items("the body", "}"):
            if self.peek() != '"':
                raise self.fail("expected a field name")
            key = self.string()
            if key in fields:
                raise RequestError(400, f"duplicate field {key!r}")
            self.expect(":")
            fields[key] = self.query() if key == "query" else self.value(1, key)
        if self.peek():
            raise self.fail("extra data after the JSON object")
        return self.validate(fields)

    def query(self) -> list[str] | Any:
        """The `query` list, each string checked as it is read (non-lists are left to `validate`)."""
        if self.peek() != "[":
            return self.value(1, "query")
        self.deeper(1)
        self.pos += 1
        out: list[str] = []
        max_chars = self.limits.max_query_chars
        for i in self.items("query", "]"):
            if self.peek() != '"':
                raise RequestError(400, f"'query' must be a list of strings; query[{i}] is not a string")
            q = self.string()
            if len(q) > max_chars:
                raise RequestError(422, f"query[{i}] has {len(q)} characters, more than --max_query_chars "
                                        f"({max_chars})")
            if not q:
                raise RequestError(422, f"query[{i}] is empty (no tokens to score)")
            if not q.isascii() and (bad := _SURROGATE.search(q)):
                raise RequestError(400, f"query[{i}] holds a lone surrogate \\u{ord(bad.group()):04x} at character "
                                        f"{bad.start()} (not valid Unicode text)")
            out.append(q)
        return out

    def value(self, depth: int, name: str) -> Any:
        char = self.peek()
        if char == '"':
            return self.string()
        if char == "[":
            inner = self.deeper(depth)
            self.pos += 1
            return [self.value(inner, name) for _ in self.items(name, "]")]
        if char == "{":
            inner = self.deeper(depth)
            self.pos += 1
            obj: dict[str, Any] = {}
            for _ in self.items(name, "}"):
                if self.peek() != '"':
                    raise self.fail("expected a field name")
                key = self.string()
                self.expect(":")
                obj[key] = self.value(inner, name)
            return obj
        return self.scalar()

    def scalar(self) -> Any:
        try:
            value, self.pos = _scan_scalar(self.text, self.pos)
        except StopIteration:
            raise self.fail("expected a value") from None
        except ValueError as e:  # e.g. an integer of more digits than int() converts
            raise RequestError(400, f"malformed JSON: {e} at character {self.pos}") from None
        return value

    @staticmethod
    def validate(fields: dict[str, Any]) -> RewardRequest:
        if "query" not in fields:
            raise RequestError(400, "missing field 'query' (a list of prompt+response strings)")
        query = fields["query"]
        if not isinstance(query, list):
            raise RequestError(400, "'query' must be a list of strings")
        extra = []
        for name in ("prompts", "labels"):
            value = fields.get(name)
            if value is not None and not isinstance(value, list):
                raise RequestError(400, f"'{name}' must be a list")
            if value is not None and len(value) not in (0, len(query)):
                raise RequestError(400, f"'{name}' has {len(value)} entries for {len(query)} queries")
            extra.append(value)
        return RewardRequest(query, extra[0], extra[1])
