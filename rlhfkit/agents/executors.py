"""The two built-in executors: single-turn (generate once, then a reward source) and multi-turn
(an ``AgentInstance`` environment; the episode loop is `episode.py`'s). Both are token in, token
out: the transcript's token ids are never re-tokenized, so what the policy trains on is exactly
what the engine sampled.

Single-turn: the prompt is tokenized (no special tokens added) and left-truncated to leave
``max_new_tokens`` of room (a prompt with pictures is never cut: its placeholder runs expand to
the pictures' tokens, which go with the request); one generation; ``reward_func``/HTTP/RM gives reward and score for the
decoded prompt + response (special tokens kept; with pictures, the prompt text holds one placeholder
per picture, not its token run), merged into batches by ``BatchingRewardSource``. Each call also
carries the sample's ``RewardSample`` (the row's prompt value and other columns, the response
without special tokens) for a reward function in TRL's shape.
"""

from __future__ import annotations

import logging
from typing import Any

from rlhfkit.agents.base import AgentConfig, AgentExecutorBase, EpisodeError
from rlhfkit.agents.decode import decoder_for
from rlhfkit.agents.episode import (  # noqa: F401
    Action,
    Transcript,
    bos_lead,
    encode,
    fit_prompt,
    generate_action,
    generate_turn,
    prompt_ids,
    run_multi_turn,
)
from rlhfkit.rewards.batching import BatchingRewardSource
from rlhfkit.rewards.process_pool import reward_source_with_workers
from rlhfkit.rewards.returns import split_reward_output
from rlhfkit.rewards.shapes import RewardSample
from rlhfkit.types import PromptSample, SamplingParams, Trajectory

logger = logging.getLogger(__name__)


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Episodes against an ``AgentInstance`` environment (a new instance per sample).

    ``class AgentExecutor(MultiTurnAgentExecutor): def __init__(self): super().__init__(AgentInstance)``
    """

    def __init__(self, agent_instance_cls: type, *args: Any, **kwargs: Any) -> None:
        if agent_instance_cls is None:
            raise TypeError("MultiTurnAgentExecutor needs an AgentInstance class")
        super().__init__(agent_instance_cls, *args, **kwargs)


# ----------------------------------------------------------------------------- single-turn


class SingleTurnAgentExecutor(AgentExecutorBase):
    """Generate once, then score with a reward source.

    ``remote_rm_url`` (OpenRLHF's argument) is a ``reward_func`` .py file (run in worker processes,
    `rewards/process_pool.py`) or HTTP URL(s); or pass a
    ``reward_source`` (e.g. the RL loop's reward model) to the constructor or ``setup``. Without
    either, trajectories keep reward 0.0 and ``self.scores_rewards`` is False: the caller must
    fill the rewards.
    """

    def __init__(self, remote_rm_url: str | list[str] | None = None, reward_source: Any = None) -> None:
        super().__init__()
        self.remote_rm_url = remote_rm_url
        self._own_source = reward_source

    def setup(self, engine: Any, tokenizer: Any, config: AgentConfig, reward_source: Any = None,
              source_name: str | None = None) -> "SingleTurnAgentExecutor":
        source = reward_source or self._own_source
        if source is None and self.remote_rm_url:
            source = reward_source_with_workers(self.remote_rm_url, timeout_s=config.reward_timeout_s)
        if source is not None and config.reward_batch_size > 1 and not isinstance(source, BatchingRewardSource):
            source = BatchingRewardSource(source, max_batch_size=config.reward_batch_size,
                                          retry_within_s=config.reward_timeout_s)
        name = source_name or getattr(source, "name", None) or "SingleTurnAgentExecutor"
        super().setup(engine, tokenizer, config, reward_source=source, source_name=name)
        self.scores_rewards = source is not None
        return self

    async def execute(self, prompt: str, label: Any, sampling_params: SamplingParams,
                      max_length: int | None = None, hf_tokenizer: Any = None, llm_engine: Any = None,
                      images: Any = None, sample: PromptSample | None = None) -> Trajectory:
        tok, engine = hf_tokenizer or self.hf_tokenizer, llm_engine or self.llm_engine
        max_length = max_length or self.max_length
        ids, pics = prompt_ids(self, tok, prompt, images, max_length, sampling_params.max_new_tokens)
        turn = await generate_turn(self, engine, ids, sampling_params, max_length - len(ids), pics)
        tr = Transcript()
        tr.add(ids, is_action=False)
        tr.add_action(turn)
        dec = decoder_for(self, tok)  # decodes of the episodes finishing together: one tokenizer call
        traj = Trajectory(token_ids=tr.token_ids, action_mask=tr.action_mask, rollout_logprobs=tr.logprobs,
                          prompt_len=len(ids), truncated=turn.finish_reason == "length", prompt=prompt,
                          response=await dec.decode(turn.ids, skip_special_tokens=True), label=label,
                          policy_versions=tr.policy_versions, images=pics)
        if self.reward_source is not None:
            if pics is None:  # the prompt's text and the response (without a BOS the BOS rule added)
                query = await dec.decode(tr.token_ids[bos_lead(tok, prompt):], skip_special_tokens=False)
            else:  # the prompt's text, with one placeholder per picture (not each picture's token run)
                query = prompt + await dec.decode(turn.ids, skip_special_tokens=False)
            row = RewardSample(prompt=prompt if sample is None or sample.input is None else sample.input,
                               completion=traj.response, completion_ids=list(turn.ids),
                               columns={} if sample is None else sample.columns)
            try:  # the sources run user code in worker threads themselves (reward_func.py)
                out = await self.reward_source([query], [prompt], [label], samples=[row])
            except EpisodeError:
                raise
            except Exception as e:
                raise EpisodeError(f"reward raised {type(e).__name__}: {e}") from e
            traj.reward, traj.score, traj.extra_logs = split_reward_output(out, 1, self.source_name)[0]
        return traj


__all__ = ["SingleTurnAgentExecutor", "MultiTurnAgentExecutor", "Transcript", "Action", "run_multi_turn",
           "generate_action", "generate_turn", "encode", "fit_prompt", "EpisodeError"]
