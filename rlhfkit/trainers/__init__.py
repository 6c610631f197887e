"""The training loops: one offline loop (SFT, RM, DPO, KTO, PRM, KD) and one online RL loop.

    offline.py      the offline loop over a task (sft_task, rm_task, dpo_task, kto_task, prm_task, kd_task)
    rl.py           RLTrainer: the RL step (rollout -> rewards -> log-probs -> advantages -> updates -> weights)
    async_rl.py     AsyncRLTrainer: RLTrainer with policy versions, engine / sleep metrics and, with
                    --async_train, a background producer (async_queue.py) a bounded number of batches ahead
    metrics.py      metrics.jsonl / TensorBoard / wandb / console lines; metric_names.py the names (train/, eval/)
    plot.py         metrics.png (a grid of smoothed panels); model_card.py README.md of saved models
"""
