"""``openrlhf.utils.agent`` under rlhfkit's name: the agent API of ``rlhfkit.agents``.

    from rlhfkit.utils.agent import AgentInstanceBase, AgentExecutorBase, MultiTurnAgentExecutor
"""

from rlhfkit.agents.base import AgentExecutorBase, AgentInstanceBase
from rlhfkit.agents.executors import MultiTurnAgentExecutor, SingleTurnAgentExecutor
from rlhfkit.agents.openai_executor import AgentSession, OpenAIAgentExecutor

__all__ = ["AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor", "SingleTurnAgentExecutor",
           "OpenAIAgentExecutor", "AgentSession"]
