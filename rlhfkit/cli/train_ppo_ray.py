"""RL training with the roles on Ray actors: `python -m rlhfkit.cli.train_ppo_ray`.

The seeds' launch path works as is:

    ray start --head --num-gpus 8
    ray job submit --address http://127.0.0.1:8265 -- python -m rlhfkit.cli.train_ppo_ray \
        --actor_num_nodes 1 --actor_num_gpus_per_node 8 --ref_num_nodes 1 --ref_num_gpus_per_node 8 \
        --vllm_num_engines 4 --colocate_all_models --pretrain PATH --remote_rm_url reward.py ...

or run it directly where a cluster runs (`--ray_address`, $RAY_ADDRESS, the last `ray start` on
this machine) or where Ray can start locally. Flags are train_ppo's plus the placement ones.

    driver (this process)                               Ray actors
    RLTrainer (the same loop as train_ppo)  --call-->   RayGroup policy / ref / critic / reward:
      executor -> RayEngineRouter -------agenerate-->     N ranks each, one torch process group per
      world size 1: the whole batch                       role (FSDP2 data parallel), batch split by rows
      weights (RayWeightSync, once per step): policy ranks gather; rank 0 broadcasts to every
      engine shard (gloo / NCCL group of its own), or each rank passes CUDA IPC handles to the
      shard on its GPU (colocated), or rank 0 -> object store -> every shard actor (--weight_sync,
      default auto); each shard keeps its slice
      engines: --vllm_num_engines x --vllm_tensor_parallel_size shard actors; an engine's shard 0
      serves requests and mirrors its steps to the others (rollout/builtin/loop/step_runner.py)

On a machine without GPUs the `--*_num_gpus_per_node` flags count CPU workers (each reserving
`--ray_num_cpus_per_worker` CPUs). `--async_train` generates the next `--async_queue_size`
batches in a background thread while the trainer trains; each trajectory records the policy
version that generated it and `staleness` (trained version - generating version) is logged.
With `--colocate_all_models` the engines stay on the training GPUs and generation overlaps
training (one warning line), except under `--vllm_enable_sleep`, where the engines sleep while
the roles work: then the two take turns (`async_mode`). `--partial_rollout` (with --async_train
and the builtin engine) lets a weight update pause the engines between decode steps instead of
waiting for the batch; generations in flight continue with the new weights and every token
records its policy version (`staleness_token_mean` / `_max`, `mixed_version_samples`); the IS
correction (--enable_vllm_is_correction) weights each token by its own rollout log-prob.
An actor that dies ends the run within seconds with its role, rank and error.
"""

from __future__ import annotations

import logging

from rlhfkit.cli.common import cli_main
from rlhfkit.cli.run_dir import training_run
from rlhfkit.cli.train_ppo import build_parser as ppo_parser
from rlhfkit.config.declare import add_fields
from rlhfkit.config.flag_parser import shell_text
from rlhfkit.config.rl_flags import RayFlags
from rlhfkit.optional import require
from rlhfkit.rl_run import builders as S
from rlhfkit.rl_run import root as R
from rlhfkit.rl_run.ray_layout import PROG, RayLayout

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__


def build_parser():
    p = ppo_parser()
    p.prog, p.description = PROG, shell_text(__doc__ or "")
    add_fields(p, RayFlags)
    return p


@training_run
def run(args, parser, hard_exit: bool = False) -> R.RLRun:
    """The run of the parsed flags `args` on Ray (rlhfkit.rl_run: one plan, then the one run sequence)."""
    layout = RayLayout(hard_exit)
    return R.run(R.plan(args, parser, layout), layout)


def main(argv: list[str] | None = None, hard_exit: bool = False) -> None:
    parser = build_parser()
    args = parser.parse(argv)
    cli_main(PROG, lambda: require("ray", PROG))  # --help works without ray; a run needs it
    from rlhfkit.distributed.health import RoleFailure
    from rlhfkit.roles.memory import RoleOutOfMemory

    try:
        cli_main(PROG, lambda: run(args, parser, hard_exit))
    except (RoleFailure, ConnectionError) as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, RoleOutOfMemory):
            e = S.explain_oom(args, cause)
        log.error(f"{PROG}: error: {e}")
        raise SystemExit(1)


if __name__ == "__main__":
    main(hard_exit=True)
