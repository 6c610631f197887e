"""``openrlhf.utils.agent`` under rlhfkit's name: the agent API of ``rlhfkit.agents``.

    from rlhfkit.utils.agent import AgentInstanceBase, AgentExecutorBase, MultiTurnAgentExecutor
"""

from rlhfkit.agents.base import AgentExecutorBase, AgentInstanceBase
from rlhfkit.agents.executors import MultiTurnAgentExecutor, SingleTurnAgentExecutor

__all__ = ["AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor", "SingleTurnAgentExecutor"]
