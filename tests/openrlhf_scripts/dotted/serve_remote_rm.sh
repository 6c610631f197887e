#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/serve_remote_rm.sh (dotted flags, OpenRLHF after ed62d0e2; the
# --fsdp.* names of that version are written --ds.*, OpenRLHF's own), adapted as a user would for one CPU:
# module renamed, tiny reward model, a free port; each changed line says so. Reads RM_MODEL, RM_PORT.
set -x

args=(
    --reward.model_name_or_path "$RM_MODEL"           # changed: OpenRLHF/Llama-3-8b-rm-700k -> tiny RM
    --port "$RM_PORT"                                 # changed: 5000 -> a free port
    --ds.param_dtype bf16
    --ds.attn_implementation sdpa                     # changed: flash_attention_2 -> sdpa (flash-attn is GPU-only)
    --reward.normalize_enable
    --data.max_len 128                                # changed: 8192 -> 128 (tiny model)
    --batch_size 16
)
exec python -m rlhfkit.cli.serve_rm "${args[@]}"      # changed: openrlhf -> rlhfkit (exec: stopping the script stops the server)
