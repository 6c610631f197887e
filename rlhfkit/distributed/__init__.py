"""Ray placement for the RL loop (the only package that imports ray).

    placement.py      slots, pools (colocation plans), feasibility check, placement groups
    workers.py        RoleWorker (one rank of policy / ref / critic / reward), EngineWorker
    group.py          RayGroup (the loop's `group.call`), RayWeights, Phases (sleep / wake), GroupBackend
    engines.py        RayEngineRouter: engine actors behind the RolloutEngine protocol, weight sync
    weight_sync.py    policy -> engines: flat buckets, gloo / NCCL broadcast group, CUDA IPC, the choice
    health.py         RoleFailure, wait_all (bounded waits), HealthMonitor (actor deaths)
    async_rollout.py  AsyncRolloutQueue: rollout in a background thread for --async_train
    launch.py         connect, launch(RoleSpec..., EngineSpec, LaunchConfig) -> LaunchedRoles

`rlhfkit.cli.train_ppo_ray` wires these to the flags and runs `trainers.rl.RLTrainer` on them.
"""
