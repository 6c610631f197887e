"""Where a reward comes from: the sources the executors score samples with (`--remote_rm_url`, the Python
API's reward functions). The reward model scores in the RL loop's own role (rlhfkit.roles).

    output.py        RewardOutput: the rewards, scores and extra logs of a batch, validated on entry
    shapes.py        the two shapes of a reward function (OpenRLHF's reward_func, TRL's reward), called alike
    returns.py       what a reward function returns, checked, for a batch of n (RewardReturnError)
    reward_file.py   a --remote_rm_url reward_func file: path.py[:name], imported once, its shape checked
    sources.py       the RewardSource protocol; a reward_func in threads (PythonRewardSource), the HTTP source,
                     and make_reward_source (--remote_rm_url -> a source)
    batching.py      BatchingRewardSource: concurrent calls merged into batch calls, failed batches retried
                     caller by caller
    process_pool.py  a reward_func file in worker processes (the default), reward_source_with_workers
    worker.py        one worker process (run as a script)
    http_client.py   the client of HTTP reward servers (serve_rm or OpenRLHF's protocol): round robin, retries
"""

from rlhfkit.rewards.batching import BatchingRewardSource
from rlhfkit.rewards.output import RewardOutput
from rlhfkit.rewards.reward_file import load_reward_func
from rlhfkit.rewards.sources import HTTPRewardSource, PythonRewardSource, RewardSource, make_reward_source

__all__ = ["RewardSource", "RewardOutput", "PythonRewardSource", "BatchingRewardSource", "HTTPRewardSource",
           "load_reward_func", "make_reward_source"]
