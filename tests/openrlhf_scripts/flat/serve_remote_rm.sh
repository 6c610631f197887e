#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/serve_remote_rm.sh (flat flags, OpenRLHF c250c21a), adapted as a
# user would for one CPU: module renamed, tiny reward model, a free port; each changed line says so.
# Reads RM_MODEL, RM_PORT from the environment.
set -x

args=(
    --reward_pretrain "$RM_MODEL"                     # changed: OpenRLHF/Llama-3-8b-rm-700k -> tiny RM
    --port "$RM_PORT"                                 # changed: 5000 -> a free port
    --bf16
    --attn_implementation sdpa                        # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
    --normalize_reward
    --max_len 128                                     # changed: 8192 -> 128 (tiny model)
    --batch_size 16
)
exec python -m rlhfkit.cli.serve_rm "${args[@]}"      # changed: openrlhf -> rlhfkit (exec: stopping the script stops the server)
