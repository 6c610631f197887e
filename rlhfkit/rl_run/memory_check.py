"""The memory plan of train_ppo_ray and train_ppo: flags -> `MemoryInputs` -> a printed table, and a refusal when the
plan exceeds the GPU (rlhfkit/distributed/memory_plan.py has the model of every byte).

    check_memory(args, {"policy": 4, "ref": 4})     before any actor starts
      model configs (--pretrain, --ref_pretrain, critic path, --reward_pretrain) -> ModelShape
      flags -> MemoryInputs -> plan_memory -> one table on stdout
      GPU memory known here (CUDA in this process, not --device cpu) and the plan over it ->
        UsageError with the numbers and the flags that would fit (--skip_memory_check runs anyway)
      the plan far inside it, without --use_dynamic_batch -> one line naming the token budget that fits

The plan is skipped (one line says why) when a model config cannot be read.
"""

from __future__ import annotations

import argparse
import logging

import torch

from rlhfkit.config.dtypes import DTYPES
from rlhfkit.cli.common import UsageError
from rlhfkit.distributed.memory_plan import (EngineMemory, MemoryInputs, ModelShape, RoleMemory,
                                             larger_train_tokens, over_budget, plan_memory)

log = logging.getLogger(__name__)



def _shape(path: str, value_head: bool = False) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.from_config(AutoConfig.from_pretrained(path), value_head=value_head)


def memory_inputs(args: argparse.Namespace, slots: dict[str, int], local: bool = False) -> MemoryInputs:
    """The plan's inputs from train_ppo_ray's (resolved) flags; `slots`: role -> ranks. `local`: train_ppo's
    layout (every role and an engine in each rank's process, nothing asleep; the engine serving the policy's
    weights where --engine_weights lets it, and a LoRA policy on its own base being its reference: no
    reference weights of their own)."""
    from rlhfkit.rl_run import builders as S

    paths = {"policy": (args.pretrain, False), "ref": (args.ref_pretrain or args.pretrain, False),
             "critic": (str(S.critic_path(args)), True),
             "reward": ((args.reward_pretrain or "").split(",")[0], True)}
    held = {r: n for r, n in slots.items() if not (local and r == "ref" and S.ref_is_policy_base(args))}
    roles = tuple(RoleMemory(r, _shape(*paths[r]), n) for r, n in held.items())
    world = slots["policy"]
    engines, tp = (world, 1) if local else (args.vllm_num_engines, args.vllm_tensor_parallel_size)
    engine = EngineMemory(roles[0].shape if roles[0].name == "policy" else _shape(args.pretrain),
                          num_engines=engines, max_num_seqs=S.engine_max_num_seqs(args, engines),
                          max_model_len=args.max_len, tp=tp, kind=args.rollout_engine,
                          gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                          shares_weights=local and S.flags_block_sharing(args, world) is None)
    train_tokens = (args.train_max_tokens_per_gpu if args.use_dynamic_batch
                    else args.micro_train_batch_size * args.max_len)
    return MemoryInputs(roles=roles, engine=engine, param_bytes=DTYPES[args.param_dtype].itemsize,
                        zero_stage=args.zero_stage, adam_offload=args.adam_offload,
                        gradient_checkpointing=args.gradient_checkpointing, torch_compile=args.torch_compile,
                        train_tokens=train_tokens,
                        forward_tokens=S.rollout_max_tokens(args) or args.micro_rollout_batch_size * args.max_len,
                        colocate_all=local or args.colocate_all_models, colocate_actor_ref=args.colocate_actor_ref,
                        colocate_critic_reward=args.colocate_critic_reward,
                        engine_sleep=args.vllm_enable_sleep,
                        train_sleep=not local and args.deepspeed_enable_sleep, local=local, lora_rank=getattr(args, "lora_rank", 0) or 0,
                        load_in_4bit=bool(getattr(args, "load_in_4bit", False)),
                        optimizers=(("policy", getattr(args, "optim", "adam"), getattr(args, "master_weights", "fp32")),
                                    ("critic", getattr(args, "critic_optim", "adam"),
                                     getattr(args, "critic_master_weights", "fp32"))))


def gpu_bytes(args: argparse.Namespace) -> int | None:
    """One GPU's memory when this process sees CUDA and the run is not on CPU workers."""
    if (args.device or "cuda").startswith("cpu") or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def check_memory(args: argparse.Namespace, slots: dict[str, int], device_bytes: int | None = None,
                 local: bool = False) -> None:
    """Print the plan; raise UsageError when it exceeds `device_bytes` (default: `gpu_bytes(args)`)."""
    try:
        inputs = memory_inputs(args, slots, local)
    except Exception as e:  # a hub id without network, an unknown architecture, ...
        log.info(f"memory plan: skipped ({type(e).__name__}: {e})")
        return
    device_bytes = device_bytes if device_bytes is not None else gpu_bytes(args)
    log.info(plan_memory(inputs, device_bytes).table(device_bytes))
    if any(r.shape.experts for r in inputs.roles):
        log.info("note: the memory plan of a mixture-of-experts model counts its weights exactly but under-counts "
                 "its peak: one measured run (Qwen3-MoE 15B, LoRA) peaked near 60 GiB where the plan says 37 "
                 "(docs/performance.md); leave room beyond it")
    msg = over_budget(inputs, device_bytes) if device_bytes else None
    if msg and not args.skip_memory_check:
        raise UsageError(msg + " (--skip_memory_check runs anyway)")
    if msg:
        log.info(f"note: {msg}; running anyway (--skip_memory_check)")
    elif device_bytes and not args.use_dynamic_batch:
        budget = larger_train_tokens(inputs, device_bytes)
        if budget:
            log.info(f"note: training micro-batches hold up to {inputs.train_tokens} tokens (--micro_train_batch_size "
                     f"{args.micro_train_batch_size} x --max_len {args.max_len}); the memory plan fits {budget} a GPU: "
                     f"--use_dynamic_batch --train_max_tokens_per_gpu {budget} trains the same step in fewer, larger "
                     "micro-batches (docs/performance.md)")
