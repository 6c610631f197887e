"""User code (reward_func files, agent environments) as the framework runs it; shared by rlhfkit.agents and
rlhfkit.rewards, and importing neither.

    run.py    run_user_code: a call in a daemon thread with its own event loop, under a time limit that ends
              even a call that blocks; EpisodeError, the failure of one sample
    files.py  import_user_file: a user's .py file imported as a fresh module, errors naming the flag and the file
"""
