"""The RL commands' composition root: resolved flags -> one plan -> one run sequence, for both placements.

    root.py          RLPlan and `plan(args, parser, layout, given)`: the resolved flags, roles and their
                     ranks, the memory plan, the tokenizer (once per process) and prompts, the LR schedule's
                     length, computed once before any model loads; `run(plan, layout)`: placement -> loop ->
                     saved policy; the Placement record the loop's collaborators travel in
    resolve.py       `resolve(args, world_size, given)`: a copy of the parsed flags checked, completed and
                     made read-only (`ResolvedFlags`); the parsed namespace is left as it was
    builders.py      resolved flags -> components (the one place the loop's components read the RL
                     namespace): roles, engine, executors, loop configs
    local.py         LocalLayout: the roles and an engine in this process (train_ppo; torchrun ranks)
    ray_layout.py    RayLayout: role groups and engines as Ray actors, the loop in the driver (train_ppo_ray)
    memory_check.py  the per-GPU memory plan, before any model loads

    cli/train_ppo.py, cli/train_ppo_ray.py:  argv -> flags -> root.run(root.plan(args, parser, layout), layout)

The two layouts differ only in how they check their flags and build the role groups, the engine and the weight
sync. The package sits above `cli` and below nothing else; it still takes the commands' shared plumbing
(logger, seeding, mesh sizes, flag checks) from `cli/common.py` and the vision-language flags from
`cli/vlm_setup.py`.
"""
