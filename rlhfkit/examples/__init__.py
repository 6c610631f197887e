"""Example user files shipped with rlhfkit: reward functions and agent environments in OpenRLHF's
formats (`--remote_rm_url FILE`, `--agent_func_path FILE`) and the offline loops of
scripts/ (rejection sampling, iterative DPO). They are plain files, loaded or run by path:

    python -m rlhfkit.examples                 # prints each file's path
    python -m rlhfkit.examples --copy examples # copies them into ./examples
    rlhfkit make_data examples --out examples  # the same copy

The repository's examples/ folder links to these files, so there is one copy of each.
Nothing here is imported by the rest of rlhfkit.
"""

from __future__ import annotations

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> what it is (the order `python -m rlhfkit.examples` prints)
FILES = {
    "reward_func.py": "exact-match reward (\\boxed{}, '####' or the first line vs the label): --remote_rm_url",
    "math_reward_func.py": "math answer reward with rlhfkit.utils.grade_answer: --remote_rm_url",
    "agent_func.py": "single-turn environment (one answer, checked against the label): --agent_func_path",
    "agent_func_multiturn.py": "multi-turn environment (a retry with feedback after a wrong answer): --agent_func_path",
    "agent_func_vlm.py": "multi-turn environment of a vision-language policy (sends a picture with its feedback): "
                         "--agent_func_path",
    "agent_func_openai.py": "agent written against the OpenAI API (needs pip install openai): --agent_func_path",
    "agent_func_gem.py": "GEM game environment (needs pip install gem-llm): --agent_func_path",
    "scripts/rejection_sampling.sh": "rejection-sampling loop: generate -> score and keep the best -> train_sft",
    "scripts/iterative_dpo.sh": "iterative DPO loop: generate -> score into pairs -> train_dpo",
}


def path(name: str) -> str:
    """The absolute path of the shipped example file `name` (e.g. "reward_func.py", "scripts/iterative_dpo.sh")."""
    if name not in FILES:
        raise FileNotFoundError(f"no example file {name!r}; there are: {', '.join(FILES)}")
    return os.path.join(HERE, name)


def copy_to(folder: str) -> list[str]:
    """Copy every example file into `folder` (made if missing); returns the written paths. A file
    that already is the shipped one (e.g. the repository's examples/ links) is left as it is."""
    out = []
    for name in FILES:
        dst = os.path.join(folder, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not (os.path.exists(dst) and os.path.samefile(dst, path(name))):
            shutil.copy(path(name), dst)  # keeps the scripts' executable bit
        out.append(dst)
    return out
