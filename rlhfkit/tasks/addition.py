"""Multi-digit addition written as text: a verifiable task a tiny model can learn on a CPU.

A row is `{"input": "12+34=", "output": "46", "label": "46"}`. The reward is 1 when the
completion, up to the end-of-sequence token, equals the label exactly, else 0.

With `reverse_answer=True` the sum is written least-significant digit first ("57+68=" -> "521"
for 125): each output digit then depends only on digits already seen and the carry just emitted,
which a 1M-parameter model learns far more reliably than carries that must be planned ahead.

Train and held-out rows never share a question: the held-out set is drawn first and the
training set excludes its questions.
"""

from __future__ import annotations

import random
from typing import Any


def _question(rng: random.Random, digits: int, reverse: bool = False) -> tuple[str, str]:
    hi = 10**digits - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    answer = str(a + b)
    return f"{a}+{b}=", answer[::-1] if reverse else answer


def addition_splits(num_train: int, num_eval: int, digits: int = 2, seed: int = 0, reverse_answer: bool = False
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and held-out rows (answers least-significant digit first with `reverse_answer`)."""
    rng = random.Random(seed)
    space = (10**digits) ** 2
    if num_eval > space // 2:
        raise ValueError(f"at most {space // 2} held-out questions exist for {digits}-digit addition")
    held: dict[str, str] = {}
    while len(held) < num_eval:
        q, a = _question(rng, digits, reverse_answer)
        held[q] = a
    train = []
    while len(train) < num_train:
        q, a = _question(rng, digits, reverse_answer)
        if q not in held:
            train.append({"input": q, "output": a, "label": a})
    return train, [{"input": q, "output": a, "label": a} for q, a in held.items()]


def completion_answer(completion: str, eos: str = "</s>") -> str:
    """The answer part of a completion: text before the first eos / newline, stripped."""
    return completion.split(eos)[0].split("\n")[0].strip()


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict[str, Any]:
    """OpenRLHF-style reward_func: exact match of the answer after the prompt."""
    rewards = []
    for q, p, lab in zip(queries, prompts, labels):
        completion = q[len(p):] if q.startswith(p) else q
        rewards.append(1.0 if completion_answer(completion) == str(lab) else 0.0)
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": {"accuracy": list(rewards)}}
