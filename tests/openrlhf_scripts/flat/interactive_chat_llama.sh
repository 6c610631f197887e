#!/usr/bin/env bash
# rlhfkit's copy of OpenRLHF examples/scripts/interactive_chat_llama.sh (flat flags; interactive_chat was
# removed in v0.9.6, so there is no dotted version), adapted as a user would for one CPU: module renamed, the
# model directory is $1 as in the original; each changed line says so. Reads the conversation from stdin.
set -x
export PATH=$HOME/.local/bin/:$PATH

python -m rlhfkit.cli.interactive_chat \
    --pretrain $1 \
    --bf16
# changed (the command above): CUDA_VISIBLE_DEVICES=0 deepspeed ../interactive_chat.py -> python -m rlhfkit.cli.interactive_chat
