"""OpenAIAgentExecutor: agent code written against the ``openai`` client, trained token in, token out.

While a batch of episodes runs, the executor serves the rollout engine behind an OpenAI-compatible
HTTP API on 127.0.0.1 (``openai_server.py``; a free port, on the event loop that runs the
episodes). Each episode gets a session and calls the user's ``run_agent`` in its own worker
thread (``usercode/run.py``), which talks to the engine through the session's base URL:

    run_episodes(samples) -- server up --> per episode:
        session = Session(seed of the episode)          base_url = http://127.0.0.1:PORT/s/<id>/v1
        run_agent(prompt, label, AgentSession)  -- AsyncOpenAI(base_url) --> /v1/chat/completions
              server: chat template -> prompt ids (continuing the last turn, openai_session.py)
                      -> engine.agenerate -> record Turn(prompt ids, generated ids, logprobs)
        -> reward (a number, or {"reward", "scores"?, "extra_logs"?})
        -> Trajectory of the session's turns (action mask over generated tokens only)
    -- server down

A user file (``--agent_func_path``) either subclasses the executor::

    class AgentExecutor(OpenAIAgentExecutor):
        async def run_agent(self, prompt, label, session):
            async with AsyncOpenAI(base_url=session.base_url, api_key=session.api_key) as client:
                reply = await client.chat.completions.create(model=session.model, messages=[...])
            return {"reward": ..., "scores": ..., "extra_logs": {...}}

or defines a module-level ``async def run_agent(prompt, label, session)`` (the loader then builds
this executor). OpenRLHF's ``extra_body={"session_id": ...}`` routing works too.

Pictures (a vision-language policy, ``--max_images_per_prompt`` > 0): chat messages may carry
OpenAI image content parts (``{"type": "image_url", "image_url": {"url": ...}}``, the URL a
``data:image/...;base64,`` URI, an http(s) URL or a file path; or ``{"type": "image", "image": ...}``).
Each becomes one placeholder in the rendered prompt; the request's pictures go to the engine with
it, and the trajectory carries the pictures of the episode's last request. A session keeps its
token ids with one placeholder token per picture; the runs are expanded for the engine and the
trajectory. A text-only policy answers a request with pictures with HTTP 400.

Failures: ``run_agent`` errors, a time limit (``--reward_timeout`` for the whole episode, generation
included) and a bad return value fall under ``--reward_failure``; an engine error ends the run
even when the agent code caught the HTTP 500 it caused.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from rlhfkit.agents.base import AgentExecutorBase, call_user, to_float, to_float_logs
from rlhfkit.agents.episode import encode
from rlhfkit.agents.openai_server import RequestError, build_app
from rlhfkit.agents.openai_session import (
    SEGMENT_POLICIES,
    Session,
    Turn,
    reward_from_agent_result,
)
from rlhfkit.usercode.run import EpisodeError, UserLoop
from rlhfkit.optional import require
from rlhfkit.types import GenerationRequest, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# request fields that would change how tokens are sampled: the trainer's settings win (one warning each)
TRAINER_SAMPLING = {"temperature": "--temperature", "top_p": "--top_p", "top_k": "--top_k", "seed": "--seed",
                    "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None,
                    "logit_bias": None, "min_p": None, "min_tokens": None, "response_format": None}


@dataclass(frozen=True)
class AgentSession:
    """What ``run_agent`` gets to reach the engine: its episode's base URL and defaults.

    base_url: ``http://127.0.0.1:PORT/s/<session_id>/v1`` (give it to ``AsyncOpenAI``);
    server_url: the same without ``/v1`` (``/tokenize`` lives there); max_tokens: the trainer's
    ``--generate_max_len`` (the most one request can get).
    """

    session_id: str
    base_url: str
    server_url: str
    model: str
    max_tokens: int
    api_key: str = "EMPTY"

    def client(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client for the episode these routes serve."""
        AsyncOpenAI = require("openai", "the OpenAI-API agent client").AsyncOpenAI
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


@dataclass
class _Serving:
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Future
    users: int = 0
    runner: Any = None


async def _start_server(app: Any) -> tuple[Any, int]:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, HOST, 0).start()
    return runner, int(runner.addresses[0][1])


class OpenAIAgentExecutor(AgentExecutorBase):
    """Runs ``run_agent`` per episode against an OpenAI-compatible server of the engine (module docstring).

    run_agent: a function ``(prompt, label, session) -> reward or dict`` (sync or async), instead
        of overriding the method. multi_segment: "last" (default: a session whose turns do not all
        continue each other trains on its last segment) or "error" (such an episode fails).
    """

    model_name: str | None = None
    multi_segment: str = "last"

    def __init__(self, run_agent: Callable[..., Any] | None = None, model_name: str | None = None,
                 multi_segment: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        require("aiohttp", "the OpenAI-compatible agent server (OpenAIAgentExecutor)")
        self._run_agent_fn = run_agent
        self.model_name = model_name or self.model_name
        self.multi_segment = multi_segment or self.multi_segment
        if self.multi_segment not in SEGMENT_POLICIES:
            raise ValueError(f"multi_segment must be one of {SEGMENT_POLICIES}, got {self.multi_segment!r}")
        self._sessions: dict[str, Session] = {}
        self._serving: _Serving | None = None
        self._warned: set[str] = set()
        self.num_split_sessions = 0

    def setup(self, engine: Any, tokenizer: Any, config: Any, reward_source: Any = None,
              source_name: str | None = None) -> "OpenAIAgentExecutor":
        super().setup(engine, tokenizer, config, reward_source=reward_source, source_name=source_name)
        self.model_name = self.model_name or getattr(tokenizer, "name_or_path", None) or "policy"
        return self

    # ---------------------------------------------------------------- the user's part

    async def run_agent(self, prompt: str, label: Any, session: AgentSession) -> Any:
        """Override (or pass ``run_agent=``): drive the episode through ``session.base_url`` and
        return its reward, or {"reward", "scores"?, "extra_logs"?}."""
        if self._run_agent_fn is None:
            raise NotImplementedError(f"{type(self).__name__} must override run_agent(prompt, label, session) "
                                      f"or be given run_agent=")
        out = self._run_agent_fn(prompt, label, session)
        return await out if inspect.isawaitable(out) else out

    # ---------------------------------------------------------------- episodes

    async def run_episodes(self, samples: Any, n_per_prompt: int = 1) -> Any:
        async with self.serving():
            return await super().run_episodes(samples, n_per_prompt)

    async def execute(self, prompt: str, label: Any, sampling_params: SamplingParams,
                      max_length: int | None = None, hf_tokenizer: Any = None, llm_engine: Any = None,
                      images: Any = None) -> Trajectory:
        async with self.serving() as port:
            sid = uuid.uuid4().hex
            session = Session(sid, sampling_params, max_length or self.max_length, self._encode)
            self._sessions[sid] = session
            root = f"http://{HOST}:{port}/s/{sid}"
            handle = AgentSession(sid, f"{root}/v1", root, self.model_name, sampling_params.max_new_tokens)
            user = UserLoop(f"rlhfkit-agent:{type(self).__name__}")
            try:
                result = await call_user(self.run_agent, prompt, label, handle, what="run_agent()",
                                         timeout_s=self.config.step_timeout_s, loop=user)
            except EpisodeError:
                if session.engine_error is not None:
                    raise session.engine_error from None
                raise
            finally:
                session.closed = True
                self._sessions.pop(sid, None)
                user.close()
            if session.engine_error is not None:
                raise session.engine_error
            return self._trajectory(session, result)

    def _trajectory(self, session: Session, result: Any) -> Trajectory:
        traj = session.trajectory(self.multi_segment, self._decode)
        if self.config.vision is not None:
            traj = _expand_trajectory(traj, session.pictures, self.config.vision)
        reward, score, logs = reward_from_agent_result(result, to_float, to_float_logs)
        if len(session.segments()) > 1:
            self.num_split_sessions += 1
            if "segments" not in self._warned:
                self._warned.add("segments")
                logger.warning("%s: an episode's turns did not all continue the turn before (%s); it trains on "
                               "its last segment (extra_logs openai_segments counts them; multi_segment='error' "
                               "fails such episodes)", self.source_name, session.breaks[0])
        traj.reward, traj.score = reward, score
        traj.extra_logs = {**traj.extra_logs, **logs}
        return traj

    @contextlib.asynccontextmanager
    async def serving(self):
        """Keep the HTTP server up on this event loop while the block runs; yields its port."""
        loop = asyncio.get_running_loop()
        st = self._serving
        if st is not None and st.loop is not loop:
            if not st.loop.is_closed():
                raise RuntimeError(f"{type(self).__name__}: its server runs on another event loop; run one batch "
                                   "of episodes at a time")
            st = self._serving = None  # left behind by a loop that was closed mid-batch
        if st is None:
            st = self._serving = _Serving(loop, loop.create_future())
            try:
                st.runner, port = await _start_server(build_app(self))
                st.ready.set_result(port)
            except BaseException:
                self._serving = None
                st.ready.cancel()
                raise
        st.users += 1
        try:
            yield await asyncio.shield(st.ready)
        finally:
            st.users -= 1
            if st.users == 0 and self._serving is st:
                self._serving = None
                if st.runner is not None:
                    await st.runner.cleanup()

    # ---------------------------------------------------------------- the server's backend

    def _encode(self, text: str, start: bool) -> list[int]:
        return encode(self.hf_tokenizer, text, start)  # start: the BOS rule (rlhfkit.data.templates)

    def _decode(self, ids: list[int]) -> str:
        return self.hf_tokenizer.decode(ids, skip_special_tokens=False)

    def find_session(self, session_id: str | None) -> Session:
        if not session_id:
            raise RequestError(400, "no session: send requests to the base_url given to run_agent "
                                    "(http://HOST:PORT/s/<session_id>/v1) or pass extra_body={'session_id': ...}")
        session = self._sessions.get(session_id)
        if session is None:
            raise RequestError(404, f"unknown session {session_id!r} (its episode has ended, or it never existed)")
        return session

    def render_chat(self, body: dict) -> str:
        tok = self.hf_tokenizer
        if not getattr(tok, "chat_template", None):
            raise RequestError(400, "the tokenizer has no chat template: use /v1/completions with a prompt string")
        vision = self.config.vision is not None
        messages = [dict(m, content=_message_content(m.get("content"), vision)) if isinstance(m, dict) else m
                    for m in body.get("messages") or []]
        cont = bool(body.get("continue_final_message", False))
        kwargs = dict(body.get("chat_template_kwargs") or {})
        try:
            return tok.apply_chat_template(messages, tools=body.get("tools"), tokenize=False,
                                           add_generation_prompt=body.get("add_generation_prompt", not cont),
                                           continue_final_message=cont, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise RequestError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}") from None

    async def complete(self, session: Session, body: dict, prompt_text: str | None,
                       prompt_ids: list[int] | None) -> Turn:
        if session.closed:
            raise RequestError(409, f"the episode of session {session.session_id} has ended")
        self._warn_ignored(body)
        stops = _stop_strings(body.get("stop"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise RequestError(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
        if prompt_ids is not None:
            vocab = len(self.hf_tokenizer)
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(400, f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        async with session.lock:
            if prompt_text is not None:
                ids, segment = session.prompt_from_text(prompt_text)
            else:
                ids, segment = session.prompt_from_ids(prompt_ids)
            p = session.params
            room = session.max_length - len(ids)
            if room < 1:
                raise RequestError(400, f"the prompt has {len(ids)} tokens: no room to generate within --max_len "
                                        f"{session.max_length}")
            limit = min(p.max_new_tokens, room, max_tokens or p.max_new_tokens)
            seed = None if p.seed is None else p.seed + 7919 * len(session.turns)
            params = p.replace(n=1, max_new_tokens=limit, seed=seed, stop=list(p.stop) + stops, logprobs=True)
            engine_ids, pictures = self._with_pictures(session, body, ids, prompt_text is not None)
            limit = min(limit, session.max_length - len(engine_ids))
            if limit < 1:
                raise RequestError(400, f"the prompt's pictures take its {len(engine_ids)} tokens past --max_len "
                                        f"{session.max_length}")
            params = params.replace(max_new_tokens=limit)
            request = GenerationRequest(engine_ids, params, request_id=self.next_request_id(), images=pictures)
            try:
                outs = await self.llm_engine.agenerate(request)
                if not outs or len(outs[0].token_ids) > limit:
                    raise RuntimeError(f"engine returned {outs!r} for a request of at most {limit} tokens")
            except Exception as e:
                session.engine_error = e
                raise RequestError(500, f"the rollout engine failed: {type(e).__name__}: {e}") from None
            c = outs[0]
            text = self._decode(list(c.token_ids))
            return session.record(ids, c, segment, prompt_text, text, self._content(c.token_ids, c.finish_reason,
                                                                                     params.stop))

    def _with_pictures(self, session: Session, body: dict, ids: list[int], chat: bool) -> tuple[list[int], Any]:
        """(the engine's prompt ids, the request's pictures): a VLM's chat request has each message's
        image parts processed and each placeholder expanded to its picture's run."""
        vision = self.config.vision
        if vision is None:
            return list(ids), None
        sources = _picture_sources(body.get("messages") or []) if chat else []
        pad = vision.layout.image_token_id
        if ids.count(pad) != len(sources):
            raise RequestError(400, f"the prompt holds {ids.count(pad)} picture placeholder(s) for {len(sources)} "
                                    "image content part(s) (pictures come as image_url parts of chat messages)")
        pictures = None
        if sources:
            from rlhfkit.data.images import check_image

            try:
                decoded = [check_image(src, f"image part {i + 1}", vision.processor.limits)[1]
                           for i, src in enumerate(sources)]
            except ValueError as e:
                raise RequestError(400, str(e)) from None
            pictures = vision.process(decoded)
        session.pictures = pictures
        return vision.expand(ids, pictures), pictures

    def _content(self, ids: list[int], finish: str, stops: list[str]) -> str:
        """The text a client gets: special tokens dropped, cut before a stop string (vLLM's way)."""
        text = self.hf_tokenizer.decode(list(ids), skip_special_tokens=True)
        if finish == "stop" and stops:
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                text = text[:min(hits)]
        return text

    def _warn_ignored(self, body: dict) -> None:
        p = self.config.sampling_params
        for key, flag in TRAINER_SAMPLING.items():
            value = body.get(key)
            if value is None or key in self._warned or (key in ("temperature", "top_p", "top_k")
                                                         and value == getattr(p, key)):
                continue
            self._warned.add(key)
            how = f"the trainer's {flag} ({getattr(p, key, None)})" if flag else "the trainer's sampling settings"
            logger.warning("%s: an OpenAI request sets %s=%r; rollouts sample with %s, so it is not used "
                           "(the policy's log-probs must match how tokens were sampled)", self.source_name, key,
                           value, how)


def _text_content(content: Any) -> Any:
    """OpenAI content parts ``[{"type": "text", "text": ...}]`` -> one string; None -> ""."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def _is_picture(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in ("image_url", "image") or "image_url" in part)


def _message_content(content: Any, vision: bool) -> Any:
    """A message's content for the chat template: text parts joined; under a VLM, image parts stay
    (as ``{"type": "image"}``, which the template renders as one placeholder) between text parts."""
    if not isinstance(content, list) or not any(_is_picture(p) for p in content):
        return _text_content(content)
    if not vision:
        raise RequestError(400, "image content parts need a vision-language policy (--max_images_per_prompt > 0)")
    return [{"type": "image"} if _is_picture(p) else {"type": "text", "text": p.get("text", "")}
            for p in content if isinstance(p, dict)]


def _picture_sources(messages: list[Any]) -> list[Any]:
    """The pictures of chat messages' image parts, in order: a URL / data URI / path or raw value."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            if not _is_picture(part):
                continue
            value = part.get("image_url", part.get("image"))
            out.append(value.get("url") if isinstance(value, dict) else value)
    return out


def _expand_trajectory(traj: Trajectory, pictures: Any, vision: Any) -> Trajectory:
    """A session's trajectory (one placeholder token per picture) with each picture's run expanded;
    the expanded tokens are not actions (mask 0, log-prob 0, version -1)."""
    pad = vision.layout.image_token_id
    if traj.token_ids.count(pad) != (0 if pictures is None else len(pictures)):
        raise EpisodeError("the episode's last segment holds other pictures than its last request")
    if pictures is None:
        return traj
    counts = iter(pictures.token_counts(vision.layout.spatial_merge_size))
    ids, mask, logps, versions = [], [], [], []
    old_versions = traj.policy_versions
    prompt_len = traj.prompt_len
    for i, t in enumerate(traj.token_ids):
        if i == traj.prompt_len:
            prompt_len = len(ids)
        n = next(counts) if t == pad else 1
        ids += [t] * n
        mask += [0] * n if t == pad else [traj.action_mask[i]]
        logps += [0.0] * n if t == pad else [traj.rollout_logprobs[i]]
        if old_versions is not None:
            versions += [-1] * n if t == pad else [old_versions[i]]
    traj.token_ids, traj.action_mask, traj.rollout_logprobs = ids, mask, logps
    traj.policy_versions = versions if old_versions is not None else None
    traj.prompt_len = prompt_len
    traj.images = pictures
    return traj


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return list(stops)
