"""Agents: token-in-token-out episode executors (reward sources: rlhfkit.rewards).

User agent files import from here exactly the names OpenRLHF's ``openrlhf.utils.agent`` gives
them (``AgentInstanceBase``, ``AgentExecutorBase``, ``MultiTurnAgentExecutor``,
``SingleTurnAgentExecutor``), and ``OpenAIAgentExecutor`` / ``AgentSession`` for agent code
written against the ``openai`` client (``openai_executor.py``). The RL loop uses ``AgentConfig``,
``build_agent_executor`` / ``SingleTurnAgentExecutor(...).setup(...)``, ``run_episodes`` and
``EpisodeBatch``.
"""

from rlhfkit.agents.base import (
                                 AgentConfig,
                                 AgentExecutorBase,
                                 AgentInstanceBase,
                                 DroppedEpisode,
                                 EpisodeBatch,
                                 EpisodeError,
                                 RewardFailure,
)
from rlhfkit.agents.executors import MultiTurnAgentExecutor, SingleTurnAgentExecutor
from rlhfkit.agents.loader import build_agent_executor, load_agent_file
from rlhfkit.agents.openai_executor import AgentSession, OpenAIAgentExecutor

__all__ = [
    "AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor", "SingleTurnAgentExecutor",
    "AgentConfig", "EpisodeBatch", "DroppedEpisode", "EpisodeError", "RewardFailure",
    "build_agent_executor", "load_agent_file", "OpenAIAgentExecutor", "AgentSession",
]
