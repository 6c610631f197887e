"""Best-of-n generation and reward scoring for offline loops: `python -m rlhfkit.cli.batch_inference`.

OpenRLHF's `batch_inference` (<= v0.9.5), the first two steps of rejection sampling, iterative DPO
and conditional SFT (examples/scripts/rejection_sampling.sh, iterative_dpo.sh):

    # 1. n samples per prompt for prompts [iter * rollout_batch_size, (iter + 1) * rollout_batch_size)
    python -m rlhfkit.cli.batch_inference --eval_task generate --pretrain POLICY --dataset prompts.jsonl \\
        --input_key question --apply_chat_template --best_of_n 8 --max_new_tokens 1024 --temperature 1.0 \\
        --iter 0 --rollout_batch_size 2048 --output_path gen.jsonl            # rows {input, output}
    # 2. score every (input, output) with a reward model, then post-process per prompt
    python -m rlhfkit.cli.batch_inference --eval_task rm --pretrain RM --dataset gen.jsonl \\
        --micro_batch_size 16 --post_processor iter_dpo --output_path pairs.jsonl

Generation (`--eval_task generate`; `generate_vllm` is the same task, OpenRLHF's name for it):

    --dataset rows (capped at --max_samples) -> [--iter slice] -> PromptDataset text
      (--apply_chat_template | --input_template; --enable_csft appends " " + --csft_prompt + " ")
    -> token ids (with the BOS the tokenizer adds, once: rlhfkit.data.templates), the first ones after it
       cut so that at most --prompt_max_len remain (the end of a prompt, with the generation prompt, is
       kept: vLLM's truncate_prompt_tokens rule)
    -> rollout engine (--rollout_engine auto | builtin | hf | vllm), --best_of_n samples per prompt,
       max new tokens = min(--max_new_tokens, L - prompt tokens), L = min(--max_len, the model's
       max_position_embeddings); --greedy_sampling = temperature 0
    -> rows {"input": prompt text (before truncation), "output": completion text}, the n samples
       of a prompt next to each other

Sampling seeds depend on (--seed, the prompt's index in the dataset) only, so a prompt gets the same
samples whatever --iter slice or batch it is generated in. `--repetition_penalty` has HF / vLLM's
meaning (tokens of the prompt and the completion so far have their logits divided by it when
positive, multiplied when negative).

Scoring (`--eval_task rm`): each row's `--input_key` / `--output_key` (default input / output) go
through the same formatting and joining rule as train_rm's data (rlhfkit.data.items: prompt ids +
response ids + eos, cut to --max_len); with --apply_chat_template and no --output_key, a row without an
`output` key is the conversation in --input_key, its last (assistant) message the output (OpenRLHF's
rule: its conditional SFT script scores `--input_key chosen` conversations this way). So a reward
model scores text as it was trained on it; the reward is the value head (`--value_head_prefix`) at the
last token, (r - mean) / std with `--normalize_reward` (mean/std stored in the reward model's
config.json). Batches of
`--micro_batch_size` rows, shortest first. Output rows are the input rows plus `reward`, or what
`--post_processor` makes of them (rs | iter_dpo | csft; see rlhfkit.data.post_processors, which
also describes `--reward_template`).

The output is written to a temporary file next to `--output_path` and renamed into place, so a
crash never leaves a partial file under that name. Errors name the flag, file and row.

Differences from OpenRLHF: one process (no deepspeed/torchrun sharding; use several processes
with different --iter slices for more GPUs); `--value_head_prefix` defaults to `score` (a prefix
stored in the model's config wins, as before); `--normalize_reward` normalises with the reward
model's stored statistics (OpenRLHF's csft processor re-normalised over the file);
`--reward_template` is used by the csft post-processor only, as in OpenRLHF.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Sequence

from rlhfkit.cli.batch_score import PROG, resolve_device, run_rm
from rlhfkit.inference.generate import (GENERATE_MAX_NEW_TOKENS, GENERATE_SEED, GenerateConfig, GenerateFlags,
                                        build_requests, encode_prompts, generate_samples, select_rows,
                                        write_jsonl_atomic)
from rlhfkit.inference.score import ScoreFlags
from rlhfkit.cli.common import (UsageError, check_packages, cli_main, resolve_model_paths, resolve_rollout_engine,
                                set_seed)
from rlhfkit.config.declare import add_fields
from rlhfkit.config.dtypes import dtype_flag_name, run_dtype
from rlhfkit.config.flags import (BACKEND, MODEL, FlagParser, add_csft_flags, add_data_flags, add_device_flag,
                                  add_local_rank_flag, add_max_new_tokens_flag, add_model_flags,
                                  add_model_name_alias_flag, add_normalize_reward_flag, add_output_path_flag,
                                  add_prefix_caching_flag, add_progress_flag, add_prompt_max_len_flag,
                                  add_rollout_batch_flag, add_rollout_engine_flag, add_sampling_flags, add_seed_flag,
                                  add_value_head_flag, add_zero_stage_flag, mark_training_only)
from rlhfkit.data.io import DataError, load_mixture
from rlhfkit.data.post_processors import csft_prompt_suffix, resolve_post_processor

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # also when run as __main__

TASKS = ("generate", "generate_vllm", "rm")
GENERATE_ONLY = ("rollout_engine", "best_of_n", "prompt_max_len", "max_new_tokens", "greedy_sampling", "temperature",
                 "top_p", "iter", "rollout_batch_size", "enable_csft", "max_num_seqs", "tp_size",
                 "enable_prefix_caching")
RM_ONLY = ("value_head_prefix", "normalize_reward", "micro_batch_size", "reward_template")


def build_parser() -> FlagParser:
    p = FlagParser(PROG, __doc__ or "")
    add_model_flags(p)
    with p.group(MODEL):
        add_model_name_alias_flag(p)
    add_data_flags(p, max_samples=int(1e8))
    with p.group("task and output"):
        p.flag("--eval_task", type=str, default=None, choices=list(TASKS),
               help="generate (alias generate_vllm): best-of-n samples; rm: score input/output rows")
        add_output_path_flag(p, "output jsonl file")
        add_seed_flag(p, "sampling seed (each prompt derives its own from it)")
        add_device_flag(p)
        add_progress_flag(p)
        p.flag("--iter", type=int, default=None,
               help="generate for prompts [iter * rollout_batch_size, (iter + 1) * rollout_batch_size)")
        add_rollout_batch_flag(p, "prompts per --iter slice", rl=False)
    with p.group("generation (--eval_task generate)"):
        add_rollout_engine_flag(p)
        add_fields(p, GenerateFlags, here=True)
        add_prompt_max_len_flag(p, "longest prompt in tokens (earlier tokens are cut)")
        add_max_new_tokens_flag(p, "new tokens of one generation at most", rl=False)
        add_sampling_flags(p)
        add_csft_flags(p)
        p.flag("--max_num_seqs", type=int, default=256, help="sequences the engine decodes at once")
        p.flag("--tp_size", type=int, default=1, help="tensor parallel size: vLLM's, or the builtin engine's over "
               "the ranks of `torchrun --nproc_per_node N` (shard 0 writes the output)")
        add_prefix_caching_flag(p, rl=False)
    with p.group("scoring (--eval_task rm)"):
        add_value_head_flag(p, "name of the reward model's value head module")
        add_normalize_reward_flag(p, "(r - mean) / std from the reward model's config")
        add_fields(p, ScoreFlags, here=True)
        p.flag("--post_processor", type=str, default=None,
               help="rs (rejection sampling), iter_dpo (iterative DPO) or csft (conditional SFT), after rm scoring")
        p.flag("--reward_template", type=str, default=None,
               help="csft input template with {input} and {reward} (default '{input} <rm_score>: {reward} ')")
    with p.group(BACKEND):
        add_local_rank_flag(p)
        add_zero_stage_flag(p, "OpenRLHF: DeepSpeed ZeRO stage of the inference model",
                            inert="one process holds the whole model: there is nothing to shard (OpenRLHF's loops "
                                  "pass 0)")
    p.set_defaults(seed=GENERATE_SEED, rollout_batch_size=2048, max_new_tokens=GENERATE_MAX_NEW_TOKENS, zero_stage=0)
    mark_training_only(p)
    for dest in ("eval_dataset", "eval_split"):
        p.mark_inert(dest, "batch_inference reads --dataset only")
    return p


# ----------------------------------------------------------------------------- output


def check_output_path(path: str | None) -> str:
    if not path:
        raise UsageError("--output_path is required (a .jsonl file to write)")
    if os.path.isdir(path):
        raise UsageError(f"--output_path {path!r} is a directory; give a file name")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


# ----------------------------------------------------------------------------- generation


def load_engine(args: argparse.Namespace, tokenizer: Any, device: str, max_model_len: int) -> Any:
    """The --rollout_engine for --pretrain (builtin/hf get a module loaded by rlhfkit's loader; the builtin
    engine takes the module's weights over rather than copying them, where it can)."""
    import torch

    from rlhfkit.config.configs import ModelConfig, from_args
    from rlhfkit.models.loader import load_causal_lm
    from rlhfkit.rollout import build_engine

    # a 4-bit module computes in bf16 (bitsandbytes), also on a CPU: the engine serving it does too
    dtype = torch.bfloat16 if args.load_in_4bit else run_dtype(args.param_dtype, device)
    if args.rollout_engine == "vllm":
        return build_engine("vllm", args.pretrain, tokenizer, dtype=dtype, seed=args.seed,
                            max_model_len=max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                            tensor_parallel_size=args.tp_size, max_num_seqs=args.max_num_seqs)
    if args.tp_size > 1:  # one engine over the torchrun ranks; each shard reads only its slices of the files
        from rlhfkit.rollout.builtin.model.tensor_parallel import from_torchrun

        tp, device = from_torchrun(args.tp_size, device)
        return build_engine("builtin", args.pretrain, tokenizer, device=device, dtype=dtype, tp=tp,
                            max_num_seqs=args.max_num_seqs, max_model_len=max_model_len)
    mcfg = from_args(ModelConfig, args, lora_rank=0, gradient_checkpointing=False,
                     param_dtype=dtype_flag_name(dtype))
    model = load_causal_lm(mcfg, device=device).eval()
    if args.rollout_engine == "hf":
        return build_engine("hf", model, tokenizer, device=device, max_batch_size=args.max_num_seqs)
    from rlhfkit.rollout.builtin.model.shared_weights import sharing_blocker

    # the loaded module's parameters move into the engine's tensors (one copy of the weights, not two); a 4-bit
    # module's stay 4-bit, dequantized a layer at a time (rollout/builtin/model/quantized.py)
    why = sharing_blocker(model, dtype, device)
    if why is not None and args.load_in_4bit:
        raise UsageError(f"--load_in_4bit: the builtin engine serves a 4-bit model only by sharing its weights, and "
                         f"here it cannot: {why}; --rollout_engine hf generates from it")
    share = why is None
    return build_engine("builtin", model, tokenizer, device=device, dtype=dtype, share_weights=share,
                        max_num_seqs=args.max_num_seqs, max_model_len=max_model_len)


def model_position_limit(path: str) -> int | None:
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)


def run_generate(args: argparse.Namespace) -> list[dict[str, str]] | None:
    from rlhfkit.data.prompts import PromptDataConfig, PromptDataset
    from rlhfkit.models.loader import load_tokenizer

    if resolve_post_processor(args.post_processor):
        raise UsageError("--post_processor applies to scored rows: run --eval_task rm on this output with it")
    cfg = GenerateConfig(args.best_of_n, args.max_new_tokens, args.prompt_max_len, args.max_len, args.temperature,
                         args.top_p, args.greedy_sampling, args.seed,
                         repetition_penalty=args.repetition_penalty)
    tokenizer = load_tokenizer(args.pretrain, padding_side="left", chat_template=args.tokenizer_chat_template,
                               use_fast=not args.disable_fast_tokenizer)
    rows = load_mixture(args.dataset, args.dataset_probs, split=args.dataset_split,
                        max_samples=args.max_samples, seed=args.seed, max_row_bytes=args.max_row_bytes)
    rows, first = select_rows(rows, args.iter, args.rollout_batch_size)
    if not rows:
        raise DataError(f"--dataset {args.dataset}: no prompts")
    data_cfg = PromptDataConfig(input_key=args.input_key, input_template=args.input_template,
                                apply_chat_template=args.apply_chat_template)
    prompts = [s.prompt for s in PromptDataset(rows, tokenizer, data_cfg).samples]
    if args.enable_csft:
        prompts = [csft_prompt_suffix(p, args.csft_prompt) for p in prompts]
    ids, cut = encode_prompts(tokenizer, prompts, cfg.prompt_max_len)
    if cut:
        log.info(f"note: {cut} of {len(ids)} prompts longer than --prompt_max_len {cfg.prompt_max_len} "
                 "were cut to their last tokens")
    limit = min(cfg.max_len, model_position_limit(args.pretrain) or cfg.max_len)
    requests = build_requests(ids, rows, cfg, first, limit)
    longest = max(len(r.prompt_token_ids) + r.params.max_new_tokens for r in requests)
    device = resolve_device(args)
    resolve_rollout_engine(args, longest + 1)
    check_engine_tp(args)
    check_4bit_engine(args)  # (auto may have become vllm)
    engine = load_engine(args, tokenizer, device, max_model_len=longest + 1)
    if getattr(engine, "tp", None) is not None and engine.tp.rank > 0:
        engine.serve()  # the other shards run shard 0's steps until it closes the engine
        return None
    out = generate_samples(engine, tokenizer, prompts, requests, cfg, not args.disable_progress)
    if getattr(engine, "tp", None) is not None:
        engine.close()
    log.info(f"{PROG}: {len(out)} samples for {len(prompts)} prompts [{first}, {first + len(prompts)})")
    return out


# ----------------------------------------------------------------------------- entry point


def check_engine_tp(args: argparse.Namespace) -> None:
    if args.tp_size > 1 and args.rollout_engine == "hf":
        raise UsageError(f"--tp_size {args.tp_size}: the hf engine runs on one device; use --rollout_engine builtin "
                         "(under torchrun) or vllm")


def check_4bit_engine(args: argparse.Namespace) -> None:
    """--load_in_4bit generation needs an engine that takes the loaded 4-bit module (builtin, hf) on one device;
    checked on the flags as given and again once --rollout_engine auto is resolved."""
    if args.load_in_4bit and args.eval_task != "rm" and (args.rollout_engine == "vllm" or args.tp_size > 1):
        raise UsageError("--load_in_4bit generates with the builtin engine (serving the loaded 4-bit module) or "
                         "the hf engine on one device; "
                         + ("--rollout_engine vllm" if args.rollout_engine == "vllm" else f"--tp_size {args.tp_size}")
                         + " loads unquantised weights")


def check_args(args: argparse.Namespace) -> None:
    if args.eval_task is None:
        raise UsageError(f"--eval_task is required: one of {', '.join(TASKS)}")
    if not args.pretrain:
        raise UsageError("--pretrain is required (the policy for generate, the reward model for rm)")
    if not args.dataset:
        raise UsageError("--dataset is required (prompts for generate, input/output rows for rm)")
    if args.lora_rank > 0:
        raise UsageError("--lora_rank: batch_inference loads full models; merge an adapter with lora_combiner")
    check_engine_tp(args)
    check_4bit_engine(args)
    check_output_path(args.output_path)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the task and write --output_path; returns the rows written."""
    check_args(args)
    check_packages(args)
    resolve_model_paths(args)
    set_seed(args.seed)
    rows = run_rm(args) if args.eval_task == "rm" else run_generate(args)
    if rows is None:  # a tensor-parallel shard other than 0: shard 0 writes
        return []
    write_jsonl_atomic(args.output_path, rows)
    log.info(f"{PROG}: wrote {len(rows)} rows to {args.output_path}")
    return rows


def note_unused(args: argparse.Namespace, parser: FlagParser) -> None:
    """Name the flags that were changed but have no effect on --eval_task."""
    other = RM_ONLY if args.eval_task in ("generate", "generate_vllm") else GENERATE_ONLY
    changed = [f"--{d}" for d in other if getattr(args, d) != parser.get_default(d)]
    if args.eval_task and changed:
        log.info(f"note: no effect with --eval_task {args.eval_task}: {', '.join(changed)}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse(argv)
    note_unused(args, parser)
    cli_main(PROG, lambda: run(args))


if __name__ == "__main__":
    from rlhfkit.parallel.rendezvous import run_main

    run_main(main)
