"""What one episode of an OpenAI-API agent sent and got back, token in, token out.

Every completion request of an episode (a *session*) becomes a ``Turn``: the prompt token ids the
engine was given and the token ids / log-probs it generated, exactly as the engine returned them.
A turn's prompt text is never re-tokenized as a whole when it continues the turn before it:

    turn k:    prompt_ids_k                          + generated_k   (turn 0: encode(text) with the BOS
                                                                      the tokenizer adds, once)
    turn k+1:  prompt_ids_k + generated_k + encode(delta)  + generated_k+1
               where the new prompt text = text_k + delta   (text_k: turn k's prompt text + its
               generated text, or + the content the client got: that drops special tokens and a
               stop string, which the chat template writes its own way, e.g. "</s>" vs "<|im_end|>";
               the model still sees the tokens it generated, as when it generated them)

so the ids of turn k+1 start with all ids of turn k (prefix-consistent) and the tokens the policy
trains on are the tokens it sampled. A prompt that does not continue the previous turn (the agent
rewrote the history, or the chat template drops earlier reasoning) starts a new *segment*.

    segment = turns t0..tk, each continuing the one before ->
    Trajectory(token_ids = tk.prompt_ids + tk.generated,
               action_mask = 1 on every turn's generated span, 0 on prompts and on the
               environment / tool text between turns, rollout_logprobs = the engine's there)

A session with several segments gives the trajectory of its last one (the others are left out
of training, counted in ``extra_logs["openai_segments"]``), or fails with ``multi_segment="error"``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlhfkit.types import Completion, SamplingParams, Trajectory
from rlhfkit.usercode.run import EpisodeError

logger = logging.getLogger(__name__)

SEGMENT_POLICIES = ("last", "error")


@dataclass
class Turn:
    """One completion request. ``prompt_text`` is None for a request given as token ids."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_text: str | None
    text: str       # generated text, special tokens kept
    content: str    # what the client got: special tokens and a trailing stop string removed
    segment: int

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids


@dataclass
class Session:
    """The turns of one episode; ``lock`` serialises its requests (a turn continues the last one).

    params: the episode's sampling settings (its seed included); ``max_length`` bounds every
    segment (prompt + generated tokens), as ``--max_len`` bounds a trajectory.
    """

    session_id: str
    params: SamplingParams
    max_length: int
    encode: Callable[[str, bool], list[int]]  # (text, starts the sequence: the BOS rule) -> ids
    turns: list[Turn] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)  # why each new segment started
    engine_error: BaseException | None = None
    closed: bool = False
    pictures: Any = None  # a VLM's: the ImageInputs of the session's last request (its trajectory's pictures)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # ---------------------------------------------------------------- prompts

    def prompt_from_text(self, text: str) -> tuple[list[int], int]:
        """Token ids for a turn asked with ``text`` and the segment it belongs to."""
        last = self.turns[-1] if self.turns else None
        if last is None:
            return self.encode(text, True), 0
        if last.prompt_text is not None:
            heads = [last.prompt_text + last.text]
            if last.content != last.text:
                heads.append(last.prompt_text + last.content)
            for head in heads:
                if text.startswith(head):
                    return last.full_ids + self.encode(text[len(head):], False), last.segment
            self.breaks.append(_first_difference(heads[0], text))
        else:
            self.breaks.append("the previous turn was asked with token ids, this one with text")
        return self.encode(text, True), last.segment + 1

    def prompt_from_ids(self, ids: Sequence[int]) -> tuple[list[int], int]:
        """A turn asked with token ids continues the last turn when it starts with all its ids."""
        ids = [int(t) for t in ids]
        last = self.turns[-1] if self.turns else None
        if last is None:
            return ids, 0
        if ids[:len(last.full_ids)] == last.full_ids:
            return ids, last.segment
        self.breaks.append(f"the prompt token ids do not start with the {len(last.full_ids)} ids of the turn before")
        return ids, last.segment + 1

    def record(self, prompt_ids: list[int], c: Completion, segment: int, prompt_text: str | None,
               text: str, content: str) -> Turn:
        logps = [0.0] * len(c.token_ids) if c.logprobs is None else [float(x) for x in c.logprobs]
        if len(logps) != len(c.token_ids):
            raise RuntimeError(f"engine returned {len(logps)} logprobs for {len(c.token_ids)} tokens")
        turn = Turn(list(prompt_ids), list(c.token_ids), logps, c.finish_reason, prompt_text, text, content, segment)
        self.turns.append(turn)
        return turn

    # ---------------------------------------------------------------- the trajectory

    def segments(self) -> list[list[Turn]]:
        out: list[list[Turn]] = []
        for t in self.turns:
            if not out or out[-1][-1].segment != t.segment:
                out.append([])
            out[-1].append(t)
        return out

    def trajectory(self, policy: str, decode: Callable[[list[int]], str]) -> Trajectory:
        """The trajectory of the last segment (layout in the module docstring)."""
        if policy not in SEGMENT_POLICIES:
            raise ValueError(f"multi_segment must be one of {SEGMENT_POLICIES}, got {policy!r}")
        segs = self.segments()
        if not segs:
            raise EpisodeError("run_agent() made no completion request through its session's base_url "
                               "(session.base_url, or extra_body={'session_id': session.session_id})")
        if len(segs) > 1 and policy == "error":
            raise EpisodeError(f"{len(segs)} turns did not continue the turn before them (multi_segment='error'); "
                               f"first: {self.breaks[0]}")
        turns = segs[-1]
        ids = turns[-1].full_ids
        mask, logps = [0] * len(ids), [0.0] * len(ids)
        for t in turns:
            start = len(t.prompt_ids)
            if ids[:start] != t.prompt_ids or ids[start:start + len(t.token_ids)] != t.token_ids:
                raise RuntimeError(f"session {self.session_id}: turn is not a prefix of the segment's last turn")
            mask[start:start + len(t.token_ids)] = [1] * len(t.token_ids)
            logps[start:start + len(t.token_ids)] = t.logprobs
        prompt_len = len(turns[0].prompt_ids)
        return Trajectory(token_ids=list(ids), action_mask=mask, rollout_logprobs=logps, prompt_len=prompt_len,
                          truncated=turns[-1].finish_reason == "length", response=decode(ids[prompt_len:]),
                          extra_logs={"openai_turns": float(len(self.turns)), "openai_segments": float(len(segs))})


def _first_difference(head: str, text: str) -> str:
    """Where a new prompt leaves the previous turn's text (for the warning that names it)."""
    i = next((k for k, (a, b) in enumerate(zip(head, text)) if a != b), min(len(head), len(text)))
    return (f"the prompt text leaves the previous turn's prompt + generated text at character {i}: "
            f"expected {head[i:i + 30]!r}, got {text[i:i + 30]!r}")


def reward_from_agent_result(result: Any, to_float: Callable[..., float],
                             to_logs: Callable[..., dict]) -> tuple[float, float, dict[str, float]]:
    """``run_agent``'s return value -> (reward, score, extra_logs). A number is the reward; a dict
    holds "reward" (or OpenRLHF's "rewards"), optional "scores" and "extra_logs"."""
    if result is None:
        raise EpisodeError("run_agent() returned None; return the episode's reward (a number) or a dict "
                           "with 'reward', optional 'scores' and 'extra_logs'")
    if not isinstance(result, dict):
        reward = to_float(result, "run_agent() result", "run_agent")
        return reward, reward, {}
    unknown = set(result) - {"reward", "rewards", "scores", "extra_logs"}
    if unknown:
        logger.warning("run_agent() returned keys that are ignored: %s (known: reward, scores, extra_logs)",
                       sorted(map(str, unknown)))
    key = "reward" if "reward" in result else "rewards"
    if result.get(key) is None:
        raise EpisodeError(f"run_agent() returned a dict without a reward (keys {sorted(result)}); "
                           f"give 'reward': a number")
    reward = to_float(result[key], f"run_agent() {key}", "run_agent")
    scores = result.get("scores")
    score = reward if scores is None else to_float(scores, "run_agent() scores", "run_agent")
    return reward, score, to_logs(result.get("extra_logs"), "run_agent() extra_logs", "run_agent")
