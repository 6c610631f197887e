"""RL training in one process or under torchrun: `python -m rlhfkit.cli.train_ppo`.

Accepts the flags of OpenRLHF's train_ppo_ray (flat names and dotted aliases):

    python -m rlhfkit.cli.train_ppo --pretrain PATH --remote_rm_url examples/reward_func.py \
        --prompt_data data.jsonl --input_key input --label_key label \
        --advantage_estimator group_norm --n_samples_per_prompt 8 --rollout_batch_size 64 \
        --train_batch_size 256 --micro_train_batch_size 8 --init_kl_coef 1e-3 --use_kl_loss \
        --generate_max_len 1024 --actor_learning_rate 1e-6 --save_path ./ckpt/grpo

Placement flags (`--*_num_nodes`, `--vllm_*`, `--colocate_*`) take effect in train_ppo_ray. This module
is argv -> flags -> run: the run is planned and assembled by rlhfkit.rl_run (the roles live in this
process: `rl_run.local`), as train_ppo_ray's is. `run(args, parser, given)` is also what the Python
API's PPO/GRPO/RLOO trainers call (rlhfkit.api.rl); `main(argv)` returns the metrics history (one dict
per logged step).
"""

from __future__ import annotations

from rlhfkit.cli.common import cli_main
from rlhfkit.cli.run_dir import training_run
from rlhfkit.config.flags import FlagParser
from rlhfkit.config.rl_flags import add_rl_flags, apply_preset
from rlhfkit.models.given import NONE, GivenModels
from rlhfkit.rl_run import root as R
from rlhfkit.rl_run.local import LocalLayout


def build_parser(preset: str | None = None, prog: str = "train_ppo", description: str | None = None) -> FlagParser:
    """train_ppo's flags; `preset` (rlhfkit.config.rl_flags.PRESETS: "grpo", "rloo") changes their defaults
    and adds TRL's flag names, for the `rlhfkit grpo` / `rlhfkit rloo` commands."""
    p = FlagParser(prog, __doc__ if description is None else description)
    add_rl_flags(p)
    if preset is not None:
        apply_preset(p, preset)
    return p


@training_run
def run(args, parser, given: GivenModels = NONE) -> R.RLRun:
    """The run of the parsed flags `args` with the roles in this process (rlhfkit.rl_run: one plan, then the
    one run sequence); `given`: models and tokenizer handed over in memory (the Python API) instead of
    loaded from --pretrain / --ref_pretrain."""
    layout = LocalLayout()
    return R.run(R.plan(args, parser, layout, given), layout)


def main(argv: list[str] | None = None, parser: FlagParser | None = None) -> list[dict]:
    """Run the command line `argv` (with `parser`, default train_ppo's); returns the metrics history (as
    written to metrics.jsonl)."""
    parser = parser or build_parser()
    args = parser.parse(argv)
    return cli_main(parser.prog, lambda: run(args, parser)).state.history


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
