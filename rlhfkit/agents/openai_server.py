"""An OpenAI-compatible HTTP front end of the rollout engine, for agents written against ``openai``.

Routes (vLLM's names; each also under ``/s/<session>/...``, the per-episode base URL):

    GET  /health, /v1/models
    POST /v1/chat/completions   messages -> chat template -> engine -> assistant message
    POST /v1/completions        prompt text or token ids -> engine -> text
    POST /tokenize              {"prompt"} or {"messages"} -> token ids;  POST /detokenize

A completion request belongs to an episode's session: the path prefix ``/s/<session>/v1`` of the
base URL handed to ``run_agent``, or ``"session_id"`` in the body (OpenRLHF's
``extra_body={"session_id": ...}``), or an ``X-Session-Id`` header. The backend (the executor)
records every turn token in, token out (``openai_session.py``); this module only parses
requests and formats answers.

Request fields: ``max_tokens`` / ``max_completion_tokens`` (capped by ``--generate_max_len`` and the
``--max_len`` budget left), ``stop``, ``logprobs`` / ``top_logprobs`` (only the sampled token is
known: ``top_logprobs`` lists it alone), ``tools`` (given to the chat template; tool calls are not
parsed: the text comes back as ``content``), ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``. Sampling comes from the trainer (``--temperature``, ``--top_p``,
``--top_k``, per-episode seeds from ``--seed``); a request that sets other values gets them
ignored with one warning per field. ``n`` must be 1 and ``stream`` false.
Errors are OpenAI-shaped: ``{"error": {"message", "type", "code"}}`` with a 4xx status.
Answers also carry the token ids: ``prompt_token_ids`` and ``choices[0].token_ids``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from rlhfkit.agents.openai_session import Session, Turn


class RequestError(Exception):
    """A request the server refuses; the message goes back to the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Backend(Protocol):
    """What the server needs from the executor."""

    model_name: str
    max_length: int
    hf_tokenizer: Any

    def find_session(self, session_id: str | None) -> Session: ...

    def render_chat(self, body: dict) -> str: ...

    async def complete(self, session: Session, body: dict, prompt_text: str | None,
                       prompt_ids: list[int] | None) -> Turn: ...


def _error(status: int, message: str):
    from aiohttp import web

    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(status, "InternalServerError")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


async def _json_body(request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise RequestError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _session_id(request, body: dict) -> str | None:
    return request.match_info.get("sid") or body.get("session_id") or request.headers.get("X-Session-Id")


def _check_single(body: dict) -> None:
    if body.get("stream"):
        raise RequestError(400, "stream=true is not supported by rlhfkit's rollout server; leave stream unset")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(400, f"n={n}: one completion per request (the n samples of a prompt are separate "
                                f"episodes, --n_samples_per_prompt)")


def _usage(turn: Turn) -> dict:
    p, c = len(turn.prompt_ids), len(turn.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _token_strs(tok: Any, ids: list[int]) -> list[str]:
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


def chat_answer(turn: Turn, body: dict, backend: Backend, request_id: str) -> dict:
    logprobs = None
    if body.get("logprobs"):
        content = []
        for s, lp in zip(_token_strs(backend.hf_tokenizer, turn.token_ids), turn.logprobs):
            entry = {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            content.append({**entry, "top_logprobs": [entry] if body.get("top_logprobs") else []})
        logprobs = {"content": content}
    return {
        "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model") or backend.model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": turn.content},
                     "finish_reason": turn.finish_reason, "logprobs": logprobs, "token_ids": turn.token_ids}],
        "usage": _usage(turn), "prompt_token_ids": turn.prompt_ids,
    }


def completion_answer(turn: Turn, body: dict, backend: Backend, request_id: str) -> dict:
    logprobs = None
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        strs = _token_strs(backend.hf_tokenizer, turn.token_ids)
        offsets, pos = [], 0
        for s in strs:
            offsets.append(pos)
            pos += len(s)
        logprobs = {"tokens": strs, "token_logprobs": turn.logprobs,
                    "top_logprobs": [{s: lp} for s, lp in zip(strs, turn.logprobs)], "text_offset": offsets}
    return {
        "id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
        "model": body.get("model") or backend.model_name,
        "choices": [{"index": 0, "text": turn.content, "finish_reason": turn.finish_reason, "logprobs": logprobs,
                     "token_ids": turn.token_ids}],
        "usage": _usage(turn), "prompt_token_ids": turn.prompt_ids,
    }


def _completion_prompt(body: dict) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    raise RequestError(400, "prompt must be one string or one list of token ids")


def build_app(backend: Backend):
    """The aiohttp application serving ``backend``."""
    from aiohttp import web

    counter = iter(range(1 << 62))

    def guarded(handler):
        async def run(request):
            try:
                return await handler(request)
            except RequestError as e:
                return _error(e.status, str(e))
        return run

    async def health(_request):
        return web.json_response({"status": "ok"})

    async def models(_request):
        return web.json_response({"object": "list", "data": [{
            "id": backend.model_name, "object": "model", "created": 0, "owned_by": "rlhfkit",
            "max_model_len": backend.max_length}]})

    async def chat(request):
        body = await _json_body(request)
        _check_single(body)
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError(400, "messages must be a non-empty list")
        session = backend.find_session(_session_id(request, body))
        text = backend.render_chat(body)
        turn = await backend.complete(session, body, text, None)
        return web.json_response(chat_answer(turn, body, backend, f"{session.session_id}-{next(counter)}"))

    async def completions(request):
        body = await _json_body(request)
        _check_single(body)
        if body.get("echo"):
            raise RequestError(400, "echo=true is not supported")
        text, ids = _completion_prompt(body)
        session = backend.find_session(_session_id(request, body))
        turn = await backend.complete(session, body, text, ids)
        return web.json_response(completion_answer(turn, body, backend, f"{session.session_id}-{next(counter)}"))

    async def tokenize(request):
        body = await _json_body(request)
        tok = backend.hf_tokenizer
        if "messages" in body:
            text = backend.render_chat(body)
            ids = tok(text, add_special_tokens=bool(body.get("add_special_tokens", False)))["input_ids"]
        elif isinstance(body.get("prompt"), str):
            ids = tok(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        else:
            raise RequestError(400, 'tokenize needs "prompt" (a string) or "messages"')
        ids = list(ids)
        out = {"count": len(ids), "max_model_len": backend.max_length, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = _token_strs(tok, ids)
        return web.json_response(out)

    async def detokenize(request):
        body = await _json_body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise RequestError(400, '"tokens" must be a list of token ids')
        return web.json_response({"prompt": backend.hf_tokenizer.decode(ids, skip_special_tokens=False)})

    app = web.Application(client_max_size=64 << 20)
    for prefix in ("", "/s/{sid}"):
        app.router.add_get(prefix + "/health", health)
        app.router.add_get(prefix + "/v1/models", models)
        app.router.add_post(prefix + "/v1/chat/completions", guarded(chat))
        app.router.add_post(prefix + "/v1/completions", guarded(completions))
        for path in ("/tokenize", "/v1/tokenize"):
            app.router.add_post(prefix + path, guarded(tokenize))
        for path in ("/detokenize", "/v1/detokenize"):
            app.router.add_post(prefix + path, guarded(detokenize))
    return app
