"""Reward sources: the ``RewardSource`` protocol, a ``reward_func`` in threads (``PythonRewardSource``), the
HTTP source, and the ``--remote_rm_url`` factory (the file is loaded by reward_file.py, answers are checked by
returns.py, concurrent calls batched by batching.py).

    --remote_rm_url /path/reward_func.py         -> worker processes (``process_pool.py``, the default), or
                                                    PythonRewardSource (here: threads; --reward_workers 0)
    --remote_rm_url http://host:5000/get_reward  -> the HTTP client of ``http_client.py``
    reward model                                 -> the RL loop's own RewardSource

A ``reward_func`` file (OpenRLHF format) defines

    def reward_func(queries, prompts, labels):      # or `async def`
        # queries: prompt + response text (special tokens kept); prompts; labels (--label_key)
        return {"rewards": B values, "scores": B values (optional, default rewards),
                "extra_logs": {name: one value or B values} (optional)}

or returns the B rewards alone (tensor / list). The function may instead be in TRL's shape,
``reward_func(prompts, completions, **kwargs)`` (``shapes.py``: completions without special
tokens, the row's other columns as keyword lists), and another function of the file may be named:
``--remote_rm_url reward.py:accuracy``. Values may be torch tensors. In PythonRewardSource
each call, sync or async, runs in a daemon thread with its own event loop (``usercode/run.py``) under
``timeout_s``, so an ``async def`` that blocks (``time.sleep``) fails in time too; but a thread that
runs past its time limit cannot be stopped: it is abandoned (the sample fails), and one that holds the
GIL stalls the trainer. That is why a file runs in worker processes unless ``--reward_workers 0``.

Failures (exception, ``SystemExit``, time limit, bad return value) raise ``EpisodeError`` naming
the file; the executor applies ``--reward_failure``. The return value is checked on every call: one
finite reward per sample (a single number for the batch is refused, whatever the batch size).
``BatchingRewardSource`` merges concurrent per-sample calls into one batch call; when that call
fails for one sample's sake (an exception, a sample's NaN, a request the server rejects) it is
retried one caller (one sample, for the executors) at a time, so only the failing samples fail,
and the error a caller gets is its own sample's. A failure of the whole call is not retried sample
by sample: an answer of the wrong shape (``RewardReturnError``) or a reward server that is down
after its own batch retries (``http_client.RewardServerDown``) fails every caller of the batch at
once.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from rlhfkit.rewards.output import RewardOutput
from rlhfkit.rewards.returns import parse_reward_return
from rlhfkit.rewards.reward_file import FLAG, is_reward_file, load_reward_func
from rlhfkit.rewards.shapes import RewardSample, call_args, reward_shape
from rlhfkit.usercode.run import run_user_code



@runtime_checkable
class RewardSource(Protocol):
    """Scores a batch; ``len(out.rewards) == len(out.scores) == len(queries)``. ``samples`` (one per
    query, or None) carry what a reward function in TRL's shape reads (``shapes.RewardSample``)."""

    async def __call__(self, queries: list[str], prompts: list[str], labels: list[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        ...



class PythonRewardSource:
    """A reward function (from a file path or a callable, in either shape of ``shapes.py``) as a
    RewardSource."""

    def __init__(self, func_or_path: str | os.PathLike | Callable[..., Any], timeout_s: float | None = 300.0,
                 name: str | None = None) -> None:
        if isinstance(func_or_path, (str, os.PathLike)):
            self.name = str(func_or_path)
            self.func = load_reward_func(self.name)
            self.label = f"{self.name}: reward_func"  # names the function in every error
        else:
            self.func = func_or_path
            self.name = self.label = name or getattr(func_or_path, "__qualname__", "reward_func")
        self.shape = reward_shape(self.func, self.label)
        self.timeout_s = timeout_s

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        n = len(queries)
        if len(prompts) != n or len(labels) != n:
            raise ValueError(f"queries/prompts/labels lengths differ: {n}, {len(prompts)}, {len(labels)}")
        args, kwargs = call_args(self.func, self.shape, list(queries), list(prompts), list(labels), samples,
                                 self.label)
        fn = functools.partial(self.func, **kwargs) if kwargs else self.func
        raw = await run_user_code(fn, *args, what=f"{self.name}: reward_func", timeout_s=self.timeout_s)
        return parse_reward_return(raw, n, self.label)


# ----------------------------------------------------------------------------- factory


def make_reward_source(remote_rm_url: str | Sequence[str] | Callable[..., Any], timeout_s: float | None = 300.0
                       ) -> Any:
    """``--remote_rm_url`` in threads: one ``.py`` file -> PythonRewardSource; URL(s) (comma-separated) ->
    HTTP; a callable ``reward_func`` (the Python API's ``reward_funcs``) -> PythonRewardSource, as a file's.
    (The commands and the executors call process_pool.reward_source_with_workers, which runs a file in
    worker processes unless ``--reward_workers 0``.)"""
    if callable(remote_rm_url):
        return PythonRewardSource(remote_rm_url, timeout_s=timeout_s)
    urls = [u.strip() for u in remote_rm_url.split(",")] if isinstance(remote_rm_url, str) else list(remote_rm_url)
    urls = [u for u in urls if u]
    if not urls:
        raise ValueError(f"{FLAG} is empty")
    if any(is_reward_file(u) for u in urls):
        if len(urls) > 1:
            raise ValueError(f"{FLAG}: give one reward_func .py file or HTTP URLs, not both: {urls}")
        return PythonRewardSource(urls[0], timeout_s=timeout_s)
    return HTTPRewardSource(urls, timeout_s=timeout_s)


class HTTPRewardSource:
    """The HTTP client of ``http_client.py`` as a RewardSource (round robin, retries)."""

    def __init__(self, urls: Sequence[str], timeout_s: float | None = 180.0, **client_kw: Any) -> None:
        from rlhfkit.rewards.http_client import RemoteRewardClient

        self.client = RemoteRewardClient(list(urls), timeout_s=timeout_s or 180.0, **client_kw)
        self.name = "reward server " + ",".join(urls)

    async def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                       samples: Sequence[RewardSample] | None = None) -> RewardOutput:
        return await self.client.get_rewards(queries, prompts, labels)  # the server's protocol: no samples
