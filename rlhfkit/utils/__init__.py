"""Helpers that OpenRLHF's example user files import from ``openrlhf.utils``.

A ``reward_func`` or agent file written for OpenRLHF runs once its import lines read

    from openrlhf.utils import extract_boxed_answer, grade_answer      ->  from rlhfkit.utils import ...
    from openrlhf.utils.agent import AgentInstanceBase, ...            ->  from rlhfkit.utils.agent import ...

``rlhfkit.utils.agent`` re-exports the agent API of ``rlhfkit.agents`` (imported on first use,
so a reward file that only grades math does not load the agent machinery).
"""

from rlhfkit.utils.math_utils import extract_boxed_answer, grade_answer, last_boxed_only_string, remove_boxed

__all__ = ["extract_boxed_answer", "grade_answer", "last_boxed_only_string", "remove_boxed"]
