"""The multi-turn episode loop and its pieces (token in, token out), shared by the executors:

    reset({"observation": prompt, "label"})  -> observation text -> tokenize once -> ids  (mask 0)
    loop until done, max_steps, or len(ids) == max_length:
        engine.agenerate(ids, max_new = min(max_new_tokens, max_length - len(ids)))
                                             -> action ids                  (mask 1, engine logprobs)
        step({"observation_text", "action_text", "label", "sampling_params"})
                                             -> feedback text, reward, done, next sampling params
        ids += action ids + tokenize(feedback)  (feedback: mask 0, logprob 0; cut at max_length)
    -> Trajectory(reward = sum of step rewards, score = last step's "scores" or that sum,
                  extra_logs = last step's, truncated = not done or last action hit its length limit)

As in OpenRLHF, the environment feedback of the final step is appended too (masked out). Each
action token keeps the policy version the engine reports for it (`Completion.policy_versions`).

Vision-language episodes (`config.vision`): the prompt's pictures, and the pictures a step returns
as `environment_images` (one placeholder each in its feedback), are processed and sent with every
later generation; their placeholders expand to each picture's token run. Pictures beyond
--max_images_per_prompt in an episode, or feedback pictures that do not fit the token budget, are
left out and their placeholder tokens stripped (as OpenRLHF does), with one warning; the trajectory
logs `episode_pictures`, the pictures it holds.
The executor is what `EpisodeHost` declares (`source_name`, `config`, `max_steps`,
`agent_instance_cls`, `next_request_id`), which `AgentExecutorBase` satisfies, so this module does
not import base.py (which imports it).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from rlhfkit.agents.contracts import (
    AgentConfig,
    call_user,
    check_reset_result,
    check_step_result,
    coerce_sampling_params,
    create_agent_instance,
)
from rlhfkit.agents.decode import decoder_for
from rlhfkit.data.templates import encode as encode_text
from rlhfkit.types import GenerationRequest, ImageInputs, ImageRef, SamplingParams, Trajectory
from rlhfkit.usercode.run import EpisodeError, UserLoop



class EpisodeHost(Protocol):
    """What an episode reads of the executor that runs it (`AgentExecutorBase` after `setup()`)."""

    source_name: str
    config: AgentConfig
    max_steps: int | None
    agent_instance_cls: type | None

    def next_request_id(self) -> int: ...

logger = logging.getLogger(__name__)


_ENCODED: "weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, bool], tuple[int, ...]]]" = weakref.WeakKeyDictionary()
_ENCODE_CACHE = 4096  # texts remembered per tokenizer


def encode(tokenizer: Any, text: str, start: bool = False) -> list[int]:
    """Text -> token ids without special tokens; `start` (a prompt, which begins the sequence): with the
    BOS the tokenizer adds, once (the BOS rule of rlhfkit.data.templates).

    The n samples of a prompt start from the same text: the last few thousand texts are remembered
    per tokenizer (a tokenizer call is mostly Python; one per sample kept the GPU waiting at the start
    of every rollout)."""
    try:
        cache = _ENCODED.setdefault(tokenizer, OrderedDict())
    except TypeError:  # not weak-referenceable: no cache
        return encode_text(tokenizer, text, start)
    key = (text, start)
    ids = cache.get(key)
    if ids is None:
        ids = tuple(encode_text(tokenizer, text, start))
        cache[key] = ids
        if len(cache) > _ENCODE_CACHE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return list(ids)


def bos_lead(tokenizer: Any, text: str) -> int:
    """How many ids the BOS rule puts before `text`'s own (0 or 1): a prompt's ids minus its text's."""
    return len(encode(tokenizer, text, start=True)) - len(encode(tokenizer, text))


def fit_prompt(ids: list[int], max_length: int, max_new_tokens: int, source: str,
               whole: bool = False) -> list[int]:
    """Left-truncate the prompt so that ``max_new_tokens`` still fit in ``max_length``
    (``max_new_tokens == max_length``: no per-generation limit, one token of room is kept).
    `whole` (a prompt with pictures, whose placeholder runs must stay intact): too long is an error."""
    room = max_length - max_new_tokens if max_new_tokens < max_length else max_length - 1
    if len(ids) > room and whole:
        raise ValueError(f"{source}: a prompt of {len(ids)} tokens with pictures does not leave --generate_max_len "
                         f"{max_new_tokens} tokens of room within --max_len {max_length}; raise --max_len or lower "
                         "--prompt_max_len")
    if len(ids) > room:
        logger.warning("%s: prompt of %d tokens left-truncated to %d (--max_len %d, --generate_max_len %d)",
                       source, len(ids), room, max_length, max_new_tokens)
        ids = ids[len(ids) - room:]
    return ids


@dataclass
class Action:
    """One generated turn: token ids, the engine's log-probs, finish reason and (when the engine
    reports them) the policy version of each token."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int] | None = None


async def generate_action(executor: EpisodeHost, engine: Any, prompt_ids: list[int],
                          params: SamplingParams, budget: int) -> tuple[list[int], list[float], str]:
    """One completion for ``prompt_ids`` with at most ``budget`` new tokens -> (ids, logprobs, finish)."""
    a = await generate_turn(executor, engine, prompt_ids, params, budget)
    return a.ids, a.logprobs, a.finish_reason


async def generate_turn(executor: EpisodeHost, engine: Any, prompt_ids: list[int],
                        params: SamplingParams, budget: int, images: ImageInputs | None = None) -> Action:
    """`generate_action` with the per-token policy versions; `images`: the pictures whose placeholder
    runs `prompt_ids` holds."""
    limit = min(params.max_new_tokens, budget)
    request = GenerationRequest(list(prompt_ids), params.replace(n=1, max_new_tokens=limit),
                                request_id=executor.next_request_id(), images=images)
    outs = await engine.agenerate(request)
    if not outs:
        raise RuntimeError(f"engine returned no completion for request {request.request_id}")
    c = outs[0]
    ids = list(c.token_ids)
    if len(ids) > limit:
        raise RuntimeError(f"engine returned {len(ids)} tokens for max_new_tokens={limit}")
    logps = [0.0] * len(ids) if c.logprobs is None else [float(x) for x in c.logprobs]
    if len(logps) != len(ids):
        raise RuntimeError(f"engine returned {len(logps)} logprobs for {len(ids)} tokens")
    versions = getattr(c, "policy_versions", None)
    if versions is not None and len(versions) != len(ids):
        raise RuntimeError(f"engine returned {len(versions)} policy versions for {len(ids)} tokens")
    return Action(ids, logps, c.finish_reason, None if versions is None else [int(v) for v in versions])


@dataclass
class Transcript:
    """Token ids of an episode with their action mask, rollout log-probs and policy versions (same
    lengths; versions are -1 off the actions). `policy_versions` is None unless every action added
    came with its versions."""

    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    _all_versioned: bool | None = None  # None: no action yet

    def add(self, ids: Sequence[int], is_action: bool, logprobs: Sequence[float] | None = None,
            versions: Sequence[int] | None = None) -> None:
        self.token_ids.extend(ids)
        self.action_mask.extend([int(is_action)] * len(ids))
        self.logprobs.extend(logprobs if is_action and logprobs is not None else [0.0] * len(ids))
        self.versions.extend(versions if is_action and versions is not None else [-1] * len(ids))
        if is_action:
            self._all_versioned = versions is not None and self._all_versioned is not False

    def add_action(self, action: Action) -> None:
        self.add(action.ids, is_action=True, logprobs=action.logprobs, versions=action.versions)

    @property
    def policy_versions(self) -> list[int] | None:
        return list(self.versions) if self._all_versioned else None

    def __len__(self) -> int:
        return len(self.token_ids)


# ----------------------------------------------------------------------------- multi-turn


@dataclass
class _Tally:
    reward: float = 0.0
    score: float | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)
    done: bool = False
    steps: int = 0
    last_finish: str = ""


def prompt_ids(ex: EpisodeHost, tok: Any, text: str, images: Sequence[ImageRef] | None,
               max_length: int, max_new_tokens: int) -> tuple[list[int], ImageInputs | None]:
    """(token ids of a prompt, fitted to the budget, and its processed pictures). The ids start with the
    BOS the tokenizer adds, once (`bos_lead`; a left-truncated prompt keeps it). Under a VLM
    (`config.vision`) each picture's placeholder expands to its token run and nothing is cut."""
    vision = ex.config.vision
    ids = encode(tok, text, start=True)
    if vision is None:
        lead = ids[:bos_lead(tok, text)]
        fitted = fit_prompt(ids, max_length, max_new_tokens, ex.source_name)
        return (fitted if fitted[:len(lead)] == lead else lead + fitted[len(lead):]), None
    pics = vision.inputs_of(images) if images else None
    try:
        ids = vision.expand(ids, pics, "the observation")
    except ValueError as e:  # reset() returned an observation without the prompt's placeholders
        raise EpisodeError(f"{e} (reset() must keep one placeholder per prompt picture)") from None
    return fit_prompt(ids, max_length, max_new_tokens, ex.source_name, whole=pics is not None), pics


def feedback_ids(ex: EpisodeHost, tok: Any, text: str, pictures: list[Any], have: int, room: int
                 ) -> tuple[list[int], ImageInputs | None]:
    """(token ids of a step's feedback, at most `room`; the pictures it shows). `have`: pictures the
    episode holds already. Pictures over --max_images_per_prompt, or all of them when the expanded
    feedback does not fit, are left out with their placeholder tokens."""
    vision = ex.config.vision
    ids = encode(tok, text)
    if vision is None:
        if pictures:
            _warn_once(f"{ex.source_name}: step() returned environment_images, which a text-only run ignores "
                       "(vision-language mode: --max_images_per_prompt > 0)")
        return ids[:room], None
    pad = vision.layout.image_token_id
    if ids.count(pad) != len(pictures):
        raise EpisodeError(f"step() environment_feedback holds {ids.count(pad)} picture placeholder(s) "
                           f"({vision.placeholder_text}) for {len(pictures)} environment_images")
    keep = max(0, min(len(pictures), vision.max_images - have))
    pics = _environment_pictures(vision, pictures[:keep])
    expanded = vision.expand(_strip_placeholders(ids, pad, keep), pics)
    if len(expanded) > room and keep:
        keep, pics = 0, None
        expanded = _strip_placeholders(ids, pad, 0)
    if keep < len(pictures):
        _warn_once(f"{ex.source_name}: {len(pictures) - keep} environment picture(s) left out (over "
                   f"--max_images_per_prompt {vision.max_images} in the episode, or over the token budget)")
    return expanded[:room], pics


def _environment_pictures(vision: Any, pictures: list[Any]) -> ImageInputs | None:
    from rlhfkit.data.images import check_image

    decoded = []
    for i, p in enumerate(pictures):
        try:
            decoded.append(check_image(p, f"environment_images[{i}]", vision.processor.limits)[1])
        except ValueError as e:
            raise EpisodeError(f"step() {e}") from None
    return vision.process(decoded)


def _strip_placeholders(ids: list[int], pad: int, keep: int) -> list[int]:
    """`ids` with the placeholder tokens after the first `keep` ones removed."""
    out, seen = [], 0
    for t in ids:
        if t == pad:
            seen += 1
            if seen > keep:
                continue
        out.append(t)
    return out


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning(msg)


async def run_multi_turn(ex: EpisodeHost, prompt: str, label: Any, params: SamplingParams,
                         max_length: int, tok: Any, engine: Any, images: Sequence[ImageRef] | None = None
                         ) -> Trajectory:
    """The multi-turn loop drawn in the module docstring (`images`: the prompt's pictures)."""
    user = UserLoop(f"rlhfkit-agent:{ex.agent_instance_cls.__name__}")  # this episode's user code runs there
    try:
        return await _multi_turn(ex, prompt, label, params, max_length, tok, engine, user, images)
    finally:
        user.close()


async def _multi_turn(ex: EpisodeHost, prompt: str, label: Any, params: SamplingParams,
                      max_length: int, tok: Any, engine: Any, user: UserLoop,
                      images: Sequence[ImageRef] | None) -> Trajectory:
    src, timeout = ex.source_name, ex.config.step_timeout_s
    agent = await create_agent_instance(ex.agent_instance_cls, timeout, user)
    reset = await call_user(agent.reset, {"observation": prompt, "label": label},
                            what="reset()", timeout_s=timeout, loop=user)
    obs_text = check_reset_result(reset)
    tr = Transcript()
    ids, pics = prompt_ids(ex, tok, obs_text, images, max_length, params.max_new_tokens)
    tr.add(ids, is_action=False)
    prompt_len, t = len(tr), _Tally()
    while not t.done and (ex.max_steps is None or t.steps < ex.max_steps) and len(tr) < max_length:
        turn = await generate_turn(ex, engine, tr.token_ids, params, max_length - len(tr), pics)
        action, t.last_finish = turn.ids, turn.finish_reason
        tr.add_action(turn)
        action_text = await decoder_for(ex, tok).decode(action, skip_special_tokens=True)
        states = {"observation_text": obs_text, "action_text": action_text, "label": label,
                  "sampling_params": params}
        res = check_step_result(await call_user(agent.step, states, what="step()", timeout_s=timeout, loop=user), src)
        t.steps += 1
        t.reward += res.reward
        t.score, t.extra_logs, t.done = res.score, res.extra_logs, res.done
        obs_text = obs_text + action_text + res.feedback
        have = 0 if pics is None else len(pics)
        fb, new = feedback_ids(ex, tok, res.feedback, res.images, have, max_length - len(tr))
        pics = ImageInputs.concat([pics, new])
        tr.add(fb, is_action=False)
        params = coerce_sampling_params(res.sampling_params, params, src)
    extra = t.extra_logs
    if ex.config.vision is not None:  # pictures the transcript holds: the prompt's and the environment's
        extra = {**extra, "episode_pictures": float(0 if pics is None else len(pics))}
    return Trajectory(
        token_ids=tr.token_ids, action_mask=tr.action_mask, rollout_logprobs=tr.logprobs,
        prompt_len=prompt_len, reward=t.reward, score=t.reward if t.score is None else t.score,
        truncated=(not t.done) or t.last_finish == "length", prompt=prompt,
        response=await decoder_for(ex, tok).decode(tr.token_ids[prompt_len:], skip_special_tokens=False), label=label,
        extra_logs=extra, policy_versions=tr.policy_versions, images=pics,
    )
