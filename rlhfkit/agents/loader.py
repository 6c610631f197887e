"""Loading user Python files: ``--agent_func_path`` agent files and (via ``import_user_file``)
``--remote_rm_url`` reward_func files.

An agent file written for OpenRLHF works once its import line reads
``from rlhfkit.agents import ...`` (or ``from rlhfkit.utils.agent import ...``) instead of
``from openrlhf.utils.agent import ...``. It defines

    class AgentInstance(AgentInstanceBase): ...            # the environment
    class AgentExecutor(MultiTurnAgentExecutor):           # optional; or AgentExecutorBase with execute()
        def __init__(self): super().__init__(AgentInstance)

A file with only ``AgentInstance`` gets ``MultiTurnAgentExecutor(AgentInstance)``; a file with neither
class but a function ``run_agent(prompt, label, session)`` gets ``OpenAIAgentExecutor(run_agent)``
(agent code on the ``openai`` client, see ``openai_executor.py``). An executor whose
``__init__`` takes arguments (older OpenRLHF: ``max_steps, max_length, llm_engine, hf_tokenizer,
result_queue``) receives them by name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rlhfkit.agents.base import AgentConfig, AgentExecutorBase, AgentInstanceBase
from rlhfkit.agents.executors import MultiTurnAgentExecutor
from rlhfkit.usercode.files import import_user_file  # noqa: F401 - agent code imports it from here

AGENT_FLAG = "--agent_func_path"


@dataclass
class AgentFile:
    """What an agent file defines."""

    path: str
    module: ModuleType
    executor_cls: type | None
    instance_cls: type | None
    run_agent: Any = None  # a module-level run_agent(prompt, label, session): the OpenAI-API executor


def _class_attr(module: ModuleType, name: str, base: type, path: str) -> type | None:
    obj = getattr(module, name, None)
    if obj is None:
        return None
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise TypeError(f"{AGENT_FLAG} {path}: {name} must be a class inheriting rlhfkit.agents.{base.__name__}, "
                        f"got {obj!r}")
    return obj


def load_agent_file(path: str) -> AgentFile:
    """Import ``path`` and find ``AgentExecutor`` and/or ``AgentInstance``."""
    module = import_user_file(path, AGENT_FLAG)
    executor_cls = _class_attr(module, "AgentExecutor", AgentExecutorBase, path)
    instance_cls = _class_attr(module, "AgentInstance", AgentInstanceBase, path)
    run_agent = getattr(module, "run_agent", None)
    if executor_cls is None and instance_cls is None and not callable(run_agent):
        raise AttributeError(f"{AGENT_FLAG} {path} must define class AgentExecutor(AgentExecutorBase), "
                             f"class AgentInstance(AgentInstanceBase) or a function run_agent(prompt, label, session)")
    return AgentFile(path=path, module=module, executor_cls=executor_cls, instance_cls=instance_cls,
                     run_agent=run_agent if callable(run_agent) else None)


def instantiate_executor(cls: type, path: str, supplied: dict[str, Any]) -> AgentExecutorBase:
    """Call ``cls(...)`` passing the arguments its ``__init__`` names from ``supplied``."""
    kwargs = {}
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in supplied:
            kwargs[p.name] = supplied[p.name]
        elif p.default is p.empty:
            raise TypeError(f"{AGENT_FLAG} {path}: {cls.__name__}.__init__ needs {p.name!r}; rlhfkit passes "
                            f"only {sorted(supplied)}")
    return cls(**kwargs)


def build_agent_executor(path: str, engine: Any, tokenizer: Any, config: AgentConfig,
                         reward_source: Any = None) -> AgentExecutorBase:
    """Load an agent file and return its executor, set up and ready for ``run_episodes``."""
    spec = load_agent_file(path)
    if spec.executor_cls is not None:
        supplied = {"max_steps": None, "max_length": config.max_length, "llm_engine": engine,
                    "hf_tokenizer": tokenizer, "result_queue": None}
        if spec.instance_cls is not None:
            supplied["agent_instance_cls"] = spec.instance_cls
        executor = instantiate_executor(spec.executor_cls, path, supplied)
    elif spec.instance_cls is not None:
        executor = MultiTurnAgentExecutor(spec.instance_cls)
    else:
        from rlhfkit.agents.openai_executor import OpenAIAgentExecutor

        executor = OpenAIAgentExecutor(run_agent=spec.run_agent)
    return executor.setup(engine, tokenizer, config, reward_source=reward_source, source_name=path)
