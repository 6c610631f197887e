"""Ray placement for the RL loop (the only package that imports ray at module level).

    placement.py      slots, pools (colocation plans), feasibility check, placement groups
    workers.py        RoleWorker (one rank of policy / ref / critic / reward), EngineWorker
    group.py          RayGroup (a RoleGroup of actors: roles/handles.py), Phases (sleep / wake), GroupBackend
    engines.py        RayEngineRouter: engine actors (and their tensor-parallel shards) behind the
                      RolloutEngine protocol; pause / resume for partial rollout
    health.py         RoleFailure, wait_all (bounded waits), HealthMonitor (actor deaths)
    launch.py         connect, launch(RoleSpec..., EngineSpec, LaunchConfig) -> LaunchedRoles

The policy -> engines weight sync (its transports, RayWeightSync) is rlhfkit/weightsync: these
actors are its peers (`RoleWorker.push_weights`, `EngineWorker.load_bucket`).

`rlhfkit.rl_run.ray_layout` wires these to the flags (a `rl_run.root.Placement`) and runs
`trainers.async_rl.AsyncRLTrainer` (the RL loop, sync or async) on them.
"""
