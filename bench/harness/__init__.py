"""What the benchmark scripts share (imported as `bench.harness.<module>`; the scripts put the repository on
sys.path first, so that this package and rlhfkit import from the checkout).

    timing.py        device syncs, means and medians, CUDA-event timing of a GPU call
    report.py        a bench's JSON report; package versions it records
    models.py        offline model directories of named shapes, random weights (also `python -m bench.harness.models`)
    vlm_shapes.py    the Qwen2.5-VL shapes of the vision-language benches
    engine_run.py    the builtin engine timed on random prompts; its profile and trace on a GPU
    train_step.py    training-step builders (plain HF, rlhfkit's variants), step timing, FLOPs and MFU
    step_profile.py  one step under torch.profiler: phases, GPU busy / idle, kernels by class
    rl_run.py        the RL-step bench's reward file, rlhfkit flags, engine batch and summary (rl_step.py and kin)
    ray_step.py      the RL step on Ray (train_ppo_ray's trainer): layouts, launch, memory
    trl_step.py      the RL step in TRL's GRPOTrainer, timed alike
"""
