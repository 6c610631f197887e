"""A reward function's answer is checked on every call (one finite reward per sample, else one line
naming the function and the mismatch, never a broadcast); a batch-shaped mistake fails the batch once,
a sample's bad value only that sample; a user file that fails to import is one line plus its frames."""

from __future__ import annotations

import asyncio
import math

import pytest

from rlhfkit.rewards.batching import BatchingRewardSource
from rlhfkit.rewards.returns import RewardReturnError
from rlhfkit.rewards.sources import PythonRewardSource
from rlhfkit.usercode.files import UserFileError, import_user_file
from rlhfkit.usercode.run import EpisodeError


def call(source, queries):
    return asyncio.run(source(queries, [""] * len(queries), [None] * len(queries)))


@pytest.mark.parametrize("n", [1, 3])
def test_one_number_for_the_batch_is_refused_naming_the_function(tmp_path, n):
    path = tmp_path / "reward.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    return 1.0\n")
    samples = "1 sample" if n == 1 else f"{n} samples"
    with pytest.raises(RewardReturnError, match=rf"^{path}: reward_func: 'rewards' is one number \(1\.0\) for "
                                                rf"{samples}; return one per sample \(a list or tensor of {n}\)$"):
        call(PythonRewardSource(str(path)), ["q"] * n)


def test_wrong_length_and_non_finite_values_name_the_function():
    def two(queries, prompts, labels):
        return [0.0, 1.0]

    with pytest.raises(RewardReturnError, match=r"two: 'rewards' has 2 values for 3 samples$"):
        call(PythonRewardSource(two), ["a", "b", "c"])

    def nan(queries, prompts, labels):
        return {"rewards": [math.nan for _ in queries]}

    with pytest.raises(EpisodeError, match=r"nan: 'rewards'\[0\] is nan \(not finite\)$"):
        call(PythonRewardSource(nan), ["a"])


def batched(fn, n):
    """n concurrent one-sample calls through a BatchingRewardSource: (results or errors, calls of fn)."""
    calls = []

    def counted(queries, prompts, labels):
        calls.append(len(queries))
        return fn(queries)

    counted.__qualname__ = fn.__name__
    src = BatchingRewardSource(PythonRewardSource(counted), max_batch_size=64)

    async def run():
        return await asyncio.gather(*(src([f"q{i}"], [""], [None]) for i in range(n)), return_exceptions=True)

    return asyncio.run(run()), calls


def test_a_batch_shaped_mistake_fails_every_sample_once_without_retries():
    def scalar(queries):
        return 1.0

    out, calls = batched(scalar, 4)
    assert calls == [4]  # one call: no retry sample by sample (where 1.0 for one sample used to pass)
    assert all(isinstance(e, RewardReturnError) and "is one number (1.0) for 4 samples" in str(e) for e in out)


def test_a_samples_bad_value_fails_that_sample_only():
    def nan_for_q2(queries):
        return [math.nan if q == "q2" else 0.5 for q in queries]

    out, calls = batched(nan_for_q2, 4)
    assert calls == [4, 1, 1, 1, 1]  # the batch, then each sample alone
    assert [o.rewards if not isinstance(o, Exception) else "error" for o in out] == [[0.5], [0.5], "error", [0.5]]


def test_a_file_that_fails_to_import_is_one_line_and_its_own_frames(tmp_path):
    (tmp_path / "helper.py").write_text("def scale():\n    return undefined_name * 2\n")
    path = tmp_path / "reward.py"
    path.write_text("import helper\n\nSCALE = helper.scale()\n\n\ndef reward_func(q, p, l):\n    return [0.0]\n")
    with pytest.raises(UserFileError) as e:
        import_user_file(str(path), "--remote_rm_url")
    lines = str(e.value).splitlines()
    assert lines[0] == (f"--remote_rm_url {path}: importing the file failed: NameError: name 'undefined_name' "
                        "is not defined")
    assert [x for x in lines[1:] if x.strip(" ^~")] == [  # (carets under the code on newer Pythons)
        f'  File "{path}", line 3, in <module>', "    SCALE = helper.scale()",
        f'  File "{tmp_path / "helper.py"}", line 2, in scale', "    return undefined_name * 2"]
    bad = tmp_path / "syntax.py"
    bad.write_text("def reward_func(q, p, l)\n    return q\n")
    with pytest.raises(UserFileError) as e:
        import_user_file(str(bad), "--remote_rm_url")
    lines = str(e.value).splitlines()
    assert lines[0].startswith(f"--remote_rm_url {bad}: importing the file failed: SyntaxError: ")
    assert lines[1] == f'  File "{bad}", line 1' and lines[2].strip() == "def reward_func(q, p, l)"
    assert "rlhfkit" not in "\n".join(lines[1:])  # no frame of ours
