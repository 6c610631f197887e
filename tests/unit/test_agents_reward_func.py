"""reward_func files (OpenRLHF format): loading, return forms, checks, time limits, batching."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time

import pytest
import torch

from rlhfkit.agents import EpisodeError
from rlhfkit.rewards import BatchingRewardSource, PythonRewardSource, RewardOutput, make_reward_source
from rlhfkit.rewards.reward_file import load_reward_func
from rlhfkit.rewards.sources import HTTPRewardSource

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "reward_func.py")


def write(tmp_path, body: str, name: str = "rf.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def score(source, queries, prompts=None, labels=None):
    prompts = prompts or [""] * len(queries)
    labels = labels or [None] * len(queries)
    return asyncio.run(source(queries, prompts, labels))


def test_dict_with_tensors(tmp_path):
    path = write(tmp_path, """
        import torch
        def reward_func(queries, prompts, labels):
            r = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
            return {"rewards": r, "scores": (r > 1).float(), "extra_logs": {"mean": r.mean(), "each": r * 10}}
    """)
    out = score(PythonRewardSource(path), ["ab", "abcd"], ["a", "a"])
    assert out.rewards == [1.0, 3.0] and out.scores == [0.0, 1.0]
    assert out.extra_logs == {"mean": 2.0, "each": [10.0, 30.0]}
    assert out.sample_logs(1) == {"mean": 2.0, "each": 30.0}


def test_plain_tensor_return_is_rewards(tmp_path):
    path = write(tmp_path, """
        import torch
        def reward_func(queries, prompts, labels):
            return torch.tensor([[1.5], [-2.0]])   # [B, 1] also accepted
    """)
    out = score(PythonRewardSource(path), ["x", "y"])
    assert out.rewards == [1.5, -2.0] and out.scores == [1.5, -2.0] and out.extra_logs == {}


def test_async_reward_func_and_labels(tmp_path):
    path = write(tmp_path, """
        import asyncio
        async def reward_func(queries, prompts, labels):
            await asyncio.sleep(0)
            return {"rewards": [float(q.endswith(l)) for q, l in zip(queries, labels)]}
    """)
    out = score(PythonRewardSource(path), ["1+1=2", "1+1=3"], labels=["2", "2"])
    assert out.rewards == [1.0, 0.0] and out.scores == [1.0, 0.0]


@pytest.mark.parametrize("ret, msg", [
    ("[1.0, 2.0, 3.0]", "'rewards' has 3 values for 2 samples"),
    ("{'rewards': [1.0, 2.0], 'scores': [1.0]}", "'scores' has 1 values for 2 samples"),
    ("{'scores': [1.0, 2.0]}", "no 'rewards'"),
    ("{'rewards': [1.0, float('inf')]}", "not finite"),
    ("{'rewards': ['a', 'b']}", "must be a number"),
    ("None", "must return a dict"),
    ("{'rewards': [1.0, 2.0], 'extra_logs': {'x': [1, 2, 3]}}", "extra_logs.x' has 3 values"),
])
def test_bad_returns_name_the_file(tmp_path, ret, msg):
    path = write(tmp_path, f"""
        def reward_func(queries, prompts, labels):
            return {ret}
    """)
    with pytest.raises(EpisodeError, match=msg) as e:
        score(PythonRewardSource(path), ["a", "b"])
    assert path in str(e.value)


def test_exception_message_names_file(tmp_path):
    path = write(tmp_path, """
        def reward_func(queries, prompts, labels):
            raise RuntimeError("verifier crashed")
    """)
    with pytest.raises(EpisodeError, match="RuntimeError: verifier crashed") as e:
        score(PythonRewardSource(path), ["a"])
    assert path in str(e.value)


def test_sync_timeout_abandons_thread(tmp_path):
    path = write(tmp_path, """
        import time
        def reward_func(queries, prompts, labels):
            time.sleep(3)
            return [1.0]
    """)
    t0 = time.perf_counter()
    with pytest.raises(EpisodeError, match="did not return within 0.1 s"):
        score(PythonRewardSource(path, timeout_s=0.1), ["a"])
    assert time.perf_counter() - t0 < 2.0  # asyncio.run did not wait for the thread


def test_async_timeout(tmp_path):
    path = write(tmp_path, """
        import asyncio
        async def reward_func(queries, prompts, labels):
            await asyncio.sleep(30)
    """)
    with pytest.raises(EpisodeError, match="did not return within 0.05 s"):
        score(PythonRewardSource(path, timeout_s=0.05), ["a"])


def test_loading_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--remote_rm_url"):
        load_reward_func(str(tmp_path / "missing.py"))
    with pytest.raises(AttributeError, match="must define reward_func"):
        load_reward_func(write(tmp_path, "def reward(q, p, l): return q\n", "a.py"))
    with pytest.raises(TypeError, match=r"reward_func\(q\) is not a reward function's signature; write "
                       r"reward_func\(queries, prompts, labels\) .* or reward\(prompts, completions, \*\*kwargs\)"):
        load_reward_func(write(tmp_path, "def reward_func(q): return q\n", "b.py"))
    with pytest.raises(ImportError, match="importing the file failed: ZeroDivisionError"):
        load_reward_func(write(tmp_path, "x = 1 / 0\n", "c.py"))


def test_sibling_import_and_same_stem_files_are_separate(tmp_path):
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    (tmp_path / "d1" / "helper_mod_d1.py").write_text("VALUE = 7.0\n")
    p1 = write(tmp_path / "d1", "from helper_mod_d1 import VALUE\ndef reward_func(q, p, l): return [VALUE] * len(q)\n")
    p2 = write(tmp_path / "d2", "def reward_func(q, p, l): return [2.0] * len(q)\n")
    assert score(PythonRewardSource(p1), ["a"]).rewards == [7.0]
    assert score(PythonRewardSource(p2), ["a"]).rewards == [2.0]


def test_batching_merges_concurrent_calls():
    calls = []

    async def source(queries, prompts, labels):
        calls.append(list(queries))
        return RewardOutput([float(len(q)) for q in queries], [0.0] * len(queries), {"batch": float(len(queries))})

    batcher = BatchingRewardSource(source, max_batch_size=3)

    async def main():
        return await asyncio.gather(*(batcher([q], [""], [None]) for q in ["a", "bb", "ccc", "dddd", "eeeee"]))

    outs = asyncio.run(main())
    assert calls == [["a", "bb", "ccc"], ["dddd", "eeeee"]]
    assert [o.rewards for o in outs] == [[1.0], [2.0], [3.0], [4.0], [5.0]]
    assert [o.extra_logs["batch"] for o in outs] == [3.0, 3.0, 3.0, 2.0, 2.0]


def test_failing_batch_is_retried_one_caller_at_a_time():
    calls = []

    async def source(queries, prompts, labels):
        calls.append(list(queries))
        if any("b" in q for q in queries):
            raise ValueError("cannot score " + ",".join(queries))
        return RewardOutput([float(len(q)) for q in queries], [0.0] * len(queries))

    batcher = BatchingRewardSource(source, max_batch_size=8)

    async def main():
        return await asyncio.gather(*(batcher([q], [""], [None]) for q in ["a", "bb", "ccc"]),
                                    return_exceptions=True)

    a, b, c = asyncio.run(main())
    assert calls[0] == ["a", "bb", "ccc"] and sorted(calls[1:]) == [["a"], ["bb"], ["ccc"]]
    assert a.rewards == [1.0] and c.rewards == [3.0]  # the real rewards of the samples that work
    assert isinstance(b, ValueError) and str(b) == "cannot score bb"  # the failing sample's own error
    assert batcher.num_retried_batches == 1


def test_failing_batch_gives_each_caller_its_own_error():
    async def source(queries, prompts, labels):
        raise ValueError("server down for " + queries[0])

    batcher = BatchingRewardSource(source, max_batch_size=8)

    async def main():
        return await asyncio.gather(*(batcher([q], [""], [None]) for q in "abc"), return_exceptions=True)

    errs = asyncio.run(main())
    assert [str(e) for e in errs] == ["server down for a", "server down for b", "server down for c"]


def test_make_reward_source(tmp_path):
    path = write(tmp_path, "def reward_func(q, p, l): return [0.5] * len(q)\n")
    assert isinstance(make_reward_source(path), PythonRewardSource)
    http = make_reward_source("http://127.0.0.1:5000/get_reward, http://127.0.0.1:5001/get_reward")
    assert isinstance(http, HTTPRewardSource) and len(http.client.urls) == 2
    with pytest.raises(ValueError, match="not both"):
        make_reward_source(f"{path},http://127.0.0.1:5000/get_reward")


def test_example_reward_func():
    src = PythonRewardSource(EXAMPLE)
    prompts = ["12+34=", "Q: 3*3?\n", "Q: 7-2?\n", "x"]
    queries = [prompts[0] + "46</s>", prompts[1] + "so \\boxed{9.0}</s>", prompts[2] + "#### 6</s>", "x"]
    out = score(src, queries, prompts, ["46", "9", "5", "1"])
    assert out.rewards == [1.0, 1.0, 0.0, 0.0] and out.extra_logs["answer_found"] == [1.0, 1.0, 1.0, 0.0]
    assert torch.equal(torch.tensor(out.scores), torch.tensor(out.rewards))
