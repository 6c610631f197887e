"""Async client for HTTP reward servers (`serve_rm` or anything speaking OpenRLHF's protocol).

    POST <url>  {"query": [full prompt+response texts], "prompts": [...], "labels": [...]}
           ->  {"rewards": [...], "scores": [...], "extra_logs": {...}}

`RemoteRewardClient(urls)` sends each call to the next URL (round robin); a failed attempt (connection
error, timeout, HTTP 5xx / 408 / 429: the server's fault, whatever the samples) is retried, the whole
batch at once, on the next URL after an exponential backoff (backoff_s * 2**attempt, capped at
max_backoff_s), up to `max_retries` retries and within `deadline_s` in all (default twice
`timeout_s`; each attempt gets at most what is left). Once they are spent the call raises
`RewardServerDown`, naming every URL tried and the last failure: the callers of the batch all fail
with it, none is retried on its own (rlhfkit.rewards.batching.BatchingRewardSource). Other 4xx
answers are the request's fault (a sample the server refuses) and raise `RewardServerError` at
once, which the batching source retries sample by sample. Answers are validated by
`RewardOutput.from_mapping` (lengths, numbers).

A server found down stays down for the client until it answers again: once a batch has failed through
every retry (`RewardServerDown`), the calls still retrying give up at their next attempt, and each new
call makes one attempt (no retries, no backoff) and fails at once when it fails, so a run under
`--reward_failure drop` gives up on a dead server within about twice `timeout_s` in all, not twice per
step; the first call that gets an answer clears it. `probe_reward_server` checks before the run that a
URL's host accepts connections (the commands refuse a server that does not).

Every failure is a `RewardServerError`, an `EpisodeError` whose text names the server: the sample fails
under `--reward_failure` as a reward_func's would, and is reported as the reward server's.

OpenRLHF's client makes 5 attempts one second apart and, on failure, leaves the sample without a
reward; here failures raise `RewardServerError`, and the caller's failure policy decides.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.parse
from typing import Any, Sequence

from rlhfkit.optional import require
from rlhfkit.redact import redact_text
from rlhfkit.rewards.output import RewardOutput
from rlhfkit.usercode.run import EpisodeError

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
PROBE_WINDOW_S = 10.0  # a server started beside the trainer may take this long to bind its port
DOWN_POLL_S = 0.25  # how often a retrying call looks whether another call has found the server down


class RewardServerError(EpisodeError):
    """A reward server could not give rewards (after retries, or a request it rejects)."""


class RewardServerDown(RewardServerError):
    """The reward server failed the whole batch (unreachable, timing out, 5xx) through every retry."""


class _Retryable(Exception):
    pass


def _aiohttp() -> Any:
    return require("aiohttp", "--remote_rm_url http://... (the HTTP reward client)", extra="serve")


class RemoteRewardClient:
    """Round-robin, retrying client for one or more reward server URLs (each the full endpoint URL)."""

    def __init__(self, urls: Sequence[str] | str, timeout_s: float = 180.0, max_retries: int = 5,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, deadline_s: float | None = None) -> None:
        urls = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else [u.strip() for u in urls]
        urls = [u for u in urls if u]
        if not urls:
            raise ValueError("--remote_rm_url: no reward server URL given")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"--remote_rm_url: not an http(s) URL: {bad}")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(f"reward client: need timeout_s > 0, max_retries >= 0, backoff_s >= 0; "
                             f"got {timeout_s}, {max_retries}, {backoff_s}")
        self.urls = urls
        self.timeout_s, self.max_retries = float(timeout_s), int(max_retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.deadline_s = 2.0 * self.timeout_s if deadline_s is None else float(deadline_s)
        self._next = 0
        self._down_at: float | None = None  # time.monotonic() when a batch last failed every retry; None: up

    # ------------------------------------------------------------------ session
    async def close(self) -> None:
        """Nothing to release: each call opens and closes its own session (event loops change between
        calls, and a session cannot move between loops)."""

    async def __aenter__(self) -> "RemoteRewardClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------------ calls
    async def get_rewards(self, queries: Sequence[str], prompts: Sequence[str] | None = None,
                          labels: Sequence[Any] | None = None) -> RewardOutput:
        """Rewards for `queries` (full prompt + response texts); prompts/labels are passed along."""
        payload = _payload(queries, prompts, labels)
        n = len(payload["query"])
        start = self._next
        self._next = (self._next + 1) % len(self.urls)
        aiohttp = _aiohttp()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            if self._down_at is not None:  # found down before: one attempt, no retries
                return await self._one_attempt(session, self.urls[start], payload, n)
            return await self._with_retries(session, start, payload, n)

    async def _with_retries(self, session: Any, start: int, payload: dict[str, Any], n: int) -> RewardOutput:
        errors: list[tuple[str, str]] = []  # (url, failure)
        loop = asyncio.get_running_loop()
        began, end = time.monotonic(), loop.time() + self.deadline_s
        for attempt in range(self.max_retries + 1):
            url = self.urls[(start + attempt) % len(self.urls)]
            try:
                data = await self._post(session, url, payload, min(self.timeout_s, max(end - loop.time(), 1e-3)))
                self._down_at = None
                return RewardOutput.from_mapping(data, n, f"reward server {url}")
            except _Retryable as e:
                errors.append((url, str(e)))
            wait_until = loop.time() + min(self.backoff_s * 2 ** attempt, self.max_backoff_s)
            if attempt == self.max_retries or wait_until >= end:
                break
            while loop.time() < wait_until and not self._found_down_since(began):
                await asyncio.sleep(min(DOWN_POLL_S, wait_until - loop.time()))
            if self._found_down_since(began):  # another call spent every retry meanwhile: down for it too
                break
        tried = ", ".join(dict.fromkeys(u for u, _ in errors))
        self._down_at = time.monotonic()
        raise RewardServerDown(f"reward server {tried} failed {len(errors)} times in a row for a batch of {n} "
                               f"(retries up to {self.max_retries} within {self.deadline_s:g} s); last error from "
                               f"{errors[-1][0]}: {errors[-1][1]}")

    async def _one_attempt(self, session: Any, url: str, payload: dict[str, Any], n: int) -> RewardOutput:
        try:
            data = await self._post(session, url, payload, self.timeout_s)
        except _Retryable as e:
            self._down_at = time.monotonic()
            raise RewardServerDown(f"reward server {url} is still down: {e} (a batch failed every retry before; "
                                   "one attempt a call until it answers)") from None
        self._down_at = None
        return RewardOutput.from_mapping(data, n, f"reward server {url}")

    def _found_down_since(self, began: float) -> bool:
        return self._down_at is not None and self._down_at >= began

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str] | None = None,
                       labels: Sequence[Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        """reward_func-style call: the same as `get_rewards` but returns the protocol's dict."""
        return (await self.get_rewards(queries, prompts, labels)).to_dict()

    async def _post(self, session: Any, url: str, payload: dict[str, Any], timeout_s: float) -> Any:
        """One attempt; raises _Retryable for transient failures, RewardServerError for final ones."""
        aiohttp = _aiohttp()
        try:
            async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                body = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            raise _Retryable(f"no answer within {timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        text = body.decode("utf-8", errors="replace")
        if status in RETRY_STATUSES:
            raise _Retryable(f"HTTP {status}: {text[:300]}")
        if status >= 400:
            raise RewardServerError(f"reward server {url} rejected the request: HTTP {status}: {text[:500]}")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RewardServerError(f"reward server {url} answered HTTP {status} with non-JSON: {text[:300]!r}") from None


def _payload(queries: Sequence[str], prompts: Sequence[str] | None,
             labels: Sequence[Any] | None) -> dict[str, Any]:
    queries = list(queries)
    if not all(isinstance(q, str) for q in queries):
        raise TypeError("reward client: every query must be a string")
    payload: dict[str, Any] = {"query": queries}
    for name, values in (("prompts", prompts), ("labels", labels)):
        if values is not None:
            values = list(values)
            if len(values) != len(queries):
                raise ValueError(f"reward client: {len(values)} {name} for {len(queries)} queries")
            payload[name] = values
    return payload


def probe_reward_server(url: str, window_s: float = PROBE_WINDOW_S) -> str | None:
    """Connect to `url`'s host and port (TCP), again every 0.25 s for up to `window_s` (a server started
    beside the trainer may not listen yet); None when it accepts a connection, else why not (the URL's
    secrets redacted). Only the connection is tried: no request reaches the reward endpoint."""
    parts = urllib.parse.urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number
        return f"{redact_text(url)}: not a valid URL ({e})"
    deadline = time.monotonic() + window_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return None
        except OSError as e:
            if time.monotonic() + 0.25 >= deadline:
                why = e.strerror or str(e) or type(e).__name__
                return f"the reward server {redact_text(url)} does not accept connections ({why}, for {window_s:g} s)"
            time.sleep(0.25)


def get_rewards_sync(urls: Sequence[str] | str, queries: Sequence[str], prompts: Sequence[str] | None = None,
                     labels: Sequence[Any] | None = None, **client_kw: Any) -> RewardOutput:
    """Blocking one-off call (scripts, batch inference): a fresh client and event loop."""

    async def _run() -> RewardOutput:
        async with RemoteRewardClient(urls, **client_kw) as client:
            return await client.get_rewards(queries, prompts, labels)

    return asyncio.run(_run())
