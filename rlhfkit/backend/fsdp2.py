"""`FSDP2Backend`: the default `TrainBackend` (PyTorch FSDP2, nothing extra to install).

    model (HF causal LM)                             ParallelDims (rlhfkit.parallel.mesh), from the flags
      |  cast: fp32 trainable weights (the masters), frozen ones in the compute dtype
      |  process group (torchrun / Ray): the mesh (dims.build_mesh(), or the one attach_mesh built)
      |  parallelize(model, dims, cfg, mesh) (rlhfkit.parallel.apply): activation checkpointing ->
      |  tp > 1: apply_tp -> torch.compile per block -> fully_shard per block + root on the mesh's
      |  data-parallel dims (dp_shard x cp with --ring_attn_size) -> cp > 1: ring attention
      |  one process, no process group: the same without FSDP2 and ring attention, then the plain
      |  module on the device (master weights or autocast on CUDA)
      v
    backend.forward(...) / .token_logprobs(...) -> loss / global count -> backend.backward(loss, sync_grads)
      -> backend.optimizer_step(): global grad norm, step guard (guard.py: skip / stop on non-finite
         numbers or divergence), clip, AdamW, weight check, zero, LR schedule

Precision (precision.py): fp32 master weights and optimizer states; compute in `--param_dtype`
(FSDP2 MixedPrecisionPolicy with fp32 gradient reduction when sharded; in one CUDA process the
module itself is cast to the compute dtype and the optimizer steps fp32 copies (master.py), or,
with `--mixed_precision autocast`, an fp32 module runs under autocast; fp32 on CPU unless
`cpu_low_precision=True`); fp16 uses a dynamic loss scale. On the GPU (no tensor parallelism)
k and v are projected by one GEMM (models/fused_qkv.py, applied by `parallelize`).

Gradient accumulation: `backward(loss, sync_grads=False)` skips the gradient reduction
(`set_requires_gradient_sync(False)`) for stages 0-2 until the last micro-batch. Stage 3 keeps
reducing every micro-batch, so gradients stay sharded (memory is what stage 3 is chosen for).

`--adam_offload` on CUDA uses FSDP2's CPUOffloadPolicy for a trainable model: the fp32 sharded
parameters, their gradients and the AdamW states live in pinned host memory and the AdamW step
runs on the CPU; the GPU holds only the gathered compute-dtype blocks. It needs a process group,
so one process without one (a one-rank Ray group, plain `python -m`) gets a one-rank group of its
own. On CPU it has no effect (one printed line says so). A frozen model ignores it.

Sleep (`offload_states` / `reload_states`, --deepspeed_enable_sleep; backend_sleep.py): the
states' storages go to host buffers allocated once and reused (offload.py), bit for bit; bf16
module parameters that have fp32 masters are freed and rebuilt from them instead of copied.
`sleep_stats` has the seconds and bytes of the last round trip.

`--optim muon` steps the 2-D hidden-layer weights with PyTorch's Muon and the rest with AdamW, as one
optimizer (muon.py). `--optim adamw_8bit` keeps AdamW's moments in 8-bit blockwise codes, and
`--master_weights bf16_stochastic | bf16_kahan` stores the trainable weights (and so their gradients) in
bf16 with no fp32 masters, on one process and sharded alike (lean_adamw.py: bytes per parameter there). `ema_decay` (--enable_ema) keeps an EMA of the trained weights in host memory,
updated after every optimizer step; `save_hf` exports the EMA weights (ema.py).

Checkpoints (rlhfkit.checkpoint.sharded) go through `sharded_state_dict()`: each rank's DTensor shards (or,
in one process, the fp32 masters) and optimizer state, written by torch.distributed.checkpoint
with no gather. `save_hf` streams full tensors one at a time into size-capped safetensors files
(rlhfkit.checkpoint.hf_export), in --save_dtype: by default the dtype of the model directory the model was
loaded from (config.json, else its weights: rlhfkit.models.hf_files.saved_dtype), whatever the training
computed in.

An inference-only backend (`optim_cfg=None`, e.g. a reference or reward model) casts the
weights to the compute dtype (no master copy is needed) and has no optimizer.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch import nn

from rlhfkit.backend.ema import EMAWeights
from rlhfkit.backend.guard import StepGuard
from rlhfkit.backend.master import MasterWeights
from rlhfkit.backend.optim_step import decide_and_step, step_grad_norm
from rlhfkit.backend.model_prep import (autocast_forward, cast_params, four_bit_weights, is_four_bit_key,
                                       without_four_bit)
from rlhfkit.backend.backend_sleep import StateOffloader
from rlhfkit.backend.offload import MoveStats
from rlhfkit.backend.optim import build_optimizer, build_scheduler, param_groups
from rlhfkit.backend.precision import DynamicLossScaler, compute_dtype_for, parse_dtype
from rlhfkit.checkpoint import sharded as ckpt
from rlhfkit.checkpoint.hf_export import export_hf, parse_size
from rlhfkit.config.configs import BackendConfig, OptimConfig
from rlhfkit.config.notes import note_once
from rlhfkit.models.forward import token_logprobs
from rlhfkit.models.hf_files import saved_dtype
from rlhfkit.models.stream_load import has_pending_weights, materialize
from rlhfkit.parallel import dist as D
from rlhfkit.parallel.apply import ParallelizeConfig, parallelize
from rlhfkit.parallel.context_parallel import check_cp
from rlhfkit.parallel.dist import DistInfo
from rlhfkit.parallel.mesh import ParallelDims
from rlhfkit.parallel.sharding import iter_full_params

log = logging.getLogger(__name__)


def _validate(cfg: BackendConfig) -> None:
    if cfg.backend != "fsdp2":
        raise ValueError(f"FSDP2Backend got --backend {cfg.backend!r}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    if cfg.mixed_precision not in ("master_weights", "autocast"):
        raise ValueError(f"--mixed_precision must be master_weights or autocast, got {cfg.mixed_precision!r}")
    parse_size(cfg.hf_max_shard_size)


class FSDP2Backend:
    """Wraps one model with its optimizer and LR schedule; see the module docstring."""

    def __init__(self, model: nn.Module, backend_cfg: BackendConfig, optim_cfg: OptimConfig | None,
                 num_training_steps: int, dist: DistInfo, *, cpu_low_precision: bool = False,
                 parallel: ParallelDims | None = None) -> None:
        """`parallel`: the mesh description built from the flags (default: data parallel over
        the whole world, sharded or replicated by --zero_stage)."""
        _validate(backend_cfg)
        self.cfg, self.optim_cfg, self.dist = backend_cfg, optim_cfg, dist
        self.parallel = parallel or ParallelDims.from_flags(dist.world_size, backend_cfg.zero_stage)
        self.parallel.check_backend(backend_cfg.zero_stage, dist)
        check_cp(model, self.parallel, backend_cfg.ring_head_stride, dist.has_process_group)  # before sharding
        self.device = torch.device(dist.device)
        self.param_dtype = parse_dtype(backend_cfg.param_dtype)
        self.compute_dtype = compute_dtype_for(self.param_dtype, self.device, cpu_low_precision)
        self.trainable = optim_cfg is not None
        # --master_weights bf16_*: the trainable weights themselves are bf16, no fp32 copy (lean_adamw.py)
        self.bf16_weights = self.trainable and optim_cfg.master_weights != "fp32"
        if self.bf16_weights:
            if self.param_dtype != torch.bfloat16:
                raise ValueError(f"--master_weights {optim_cfg.master_weights} keeps the weights in bf16: it needs "
                                 f"--param_dtype bf16, got {backend_cfg.param_dtype}")
            self.compute_dtype = torch.bfloat16  # also on CPU: the weights are bf16
        # what save_hf writes by default: the dtype of the model directory this model was loaded from (a bf16
        # base stays bf16 after fp32 CPU training), else the compute dtype
        self.save_dtype = (parse_dtype(backend_cfg.save_dtype) if backend_cfg.save_dtype != "auto"
                           else saved_dtype(getattr(model, "name_or_path", None)) or self.compute_dtype)
        self.cpu_offload = backend_cfg.adam_offload and self.trainable and self.device.type == "cuda"
        if backend_cfg.adam_offload and self.trainable and self.device.type != "cuda" and dist.rank == 0:
            note_once("note: --adam_offload has no effect on CPU (the optimizer states are already in host memory)")
        if self.cpu_offload and not dist.has_process_group:
            D.init_single_rank_group(dist.device)  # FSDP2's CPUOffloadPolicy needs a process group
        self.is_sharded = dist.has_process_group
        self._unsynced = False
        self.four_bit = four_bit_weights(model)  # a QLoRA base: kept out of checkpoints (model_prep.py)
        master = torch.float32 if self.trainable and not self.bf16_weights else self.compute_dtype
        cast_params(model, master, trainable_only=self.trainable)
        if self.trainable:  # frozen weights (a LoRA base, a frozen vision tower) have no masters: compute dtype
            cast_params(model, self.compute_dtype, trainable_only=False, frozen_only=True)
        self.mesh = self._build_mesh() if self.is_sharded else None
        self.master: MasterWeights | None = None
        # checkpointing, TP, compile, FSDP2, ring attention: all of it in parallel/apply.py
        done = parallelize(model, self.parallel, self._parallelize_config(), self.mesh)
        self.model = done.model if self.is_sharded else self._place(done.model)
        self._loss_multiplier = done.loss_multiplier
        # ring attention (--ring_attn_size): each sequence split over the cp group (parallel/context_parallel.py)
        self.context_parallel = done.context_parallel
        if self.trainable:
            # a loaded model comes in eval mode, where HF skips activation checkpointing (and dropout);
            # a backend that trains starts in training mode, as the trainers of other stacks put it
            self.model.train()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.loss_scaler: DynamicLossScaler | None = None
        self.guard: StepGuard | None = None
        self._named_cache: tuple[tuple[int, ...], list[tuple[str, torch.Tensor]]] | None = None
        self.ema: EMAWeights | None = None
        if self.trainable:
            self.guard = StepGuard(optim_cfg.max_nonfinite_steps, optim_cfg.max_weight_growth,
                                   optim_cfg.max_zero_grad_steps)
            groups = None
            if self.master is not None:
                groups = self.master.param_groups(param_groups(self.model, optim_cfg.l2, optim_cfg.optim == "muon"))
            # fused: one kernel per parameter group, and no temporaries the size of the moments (the foreach
            # implementation allocates one, e.g. 7 GiB a GPU at 7B over 4 ranks); on a CPU torch's fused AdamW
            # is one vectorised pass, 3x faster than its default per-tensor loop (0.21 against 0.68 s a step
            # for 148M parameters on one core). Master copies on a CPU keep the plain AdamW (MasterAdamW is
            # the CUDA kernel's). A CPU run takes the same kernel whether or not --adam_offload is given.
            on_cuda = self.device.type == "cuda"
            fused = not backend_cfg.adam_offload if on_cuda else self.master is None
            self.optimizer = build_optimizer(self.model, optim_cfg, groups=groups, master=self.master, fused=fused,
                                             seed=backend_cfg.seed)
            self.scheduler = build_scheduler(self.optimizer, optim_cfg, num_training_steps)
            if self.compute_dtype == torch.float16:
                self.loss_scaler = DynamicLossScaler()
            elif self.master is not None and getattr(self.optimizer, "kernel_usable", lambda: False)():
                self.master.keep_low_grads = True  # read by the fused step (master_adamw.py)
            if backend_cfg.ema_decay is not None:
                self.ema = EMAWeights(self._named_params(self._params()), backend_cfg.ema_decay)
        self.offloader = StateOffloader(self.model, self.master, self.optimizer, self.device, self.is_sharded,
                                        on_host=self.cpu_offload)

    # ------------------------------------------------------------------ sleep (backend_sleep.py)

    def offload_states(self) -> MoveStats:
        return self.offloader.offload()

    def reload_states(self) -> MoveStats:
        return self.offloader.reload()

    @property
    def sleep_stats(self) -> dict[str, float]:
        return self.offloader.stats

    def _wake(self) -> None:
        self.offloader.wake()

    # ------------------------------------------------------------------ wrapping

    def _place(self, model: nn.Module) -> nn.Module:
        if has_pending_weights(model):  # built on the meta device: streamed onto the device, tensor by tensor
            materialize(model, self.device)
        model = model.to(self.device)
        if self.trainable and self.compute_dtype != torch.float32 and not self.bf16_weights:
            if self.cfg.mixed_precision == "master_weights":
                self.master = MasterWeights(model, self.compute_dtype)
            else:
                autocast_forward(model, self.device.type, self.compute_dtype)
        return model

    def _build_mesh(self) -> Any:
        shared = self.dist.mesh  # built once by parallel.attach_mesh, when it describes the same mesh
        if shared is not None and shared.device_mesh is not None and shared.dims == self.parallel:
            return shared.device_mesh
        return self.parallel.build_mesh(self.device.type)

    def _parallelize_config(self) -> ParallelizeConfig:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        low = self.compute_dtype if self.compute_dtype != torch.float32 else None
        mp = MixedPrecisionPolicy(param_dtype=low if self.trainable else None, reduce_dtype=torch.float32)
        return ParallelizeConfig(
            zero_stage=self.cfg.zero_stage, activation_checkpointing=self.cfg.gradient_checkpointing and self.trainable,
            compile=self.cfg.torch_compile, compile_dynamic=self.cfg.compile_dynamic,
            fuse_qkv=self.device.type == "cuda", ring_head_stride=self.cfg.ring_head_stride, device=str(self.device),
            mp_policy=mp, offload=CPUOffloadPolicy(pin_memory=True) if self.cpu_offload else None)

    # ------------------------------------------------------------------ training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward pass (roles call this, not `self.model`: the one place for input hooks)."""
        return self.model(*args, **kwargs)

    def token_logprobs(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """`rlhfkit.models.forward.token_logprobs` of the model (same keywords)."""
        return token_logprobs(self.model, input_ids, **kwargs)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def unwrap(self) -> nn.Module:
        return self.model

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (skipped non-finite steps excluded); restored on resume."""
        return int(self.scheduler.last_epoch) if self.scheduler is not None else 0

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("this backend was built without an optimizer (optim_cfg=None)")
        return self.optimizer

    def backward(self, loss: torch.Tensor, sync_grads: bool = True) -> None:
        """loss.backward(); gradients end up summed over ranks once `sync_grads` is True."""
        self._require_optimizer()
        if self.is_sharded:
            self.model.set_requires_gradient_sync(sync_grads or self.cfg.zero_stage == 3)
        self._unsynced = not sync_grads and self.is_sharded and self.cfg.zero_stage != 3
        self.guard.note_loss(loss)
        if self.cfg.gradient_checkpointing and not self.model.training and self.dist.rank == 0:
            note_once("note: a backward pass of a model in eval mode: --gradient_checkpointing has no effect there "
                      "(transformers checkpoints only in training mode; call backend.train())")
        scale = self._loss_multiplier * (self.loss_scaler.scale if self.loss_scaler else 1.0)
        (loss * scale if scale != 1.0 else loss).backward()

    def _params(self) -> list[nn.Parameter]:
        return [p for g in self._require_optimizer().param_groups for p in g["params"]]

    def optimizer_step(self) -> dict[str, float]:
        """Global grad norm -> (skip if it or a loss was non-finite on any rank) clip to --max_norm
        -> AdamW -> check the weights (read with the next step's decision) -> zero -> LR step. Raises
        NonFiniteError (guard.py) after more than --max_nonfinite_steps skips in a row or when the
        previous step left a non-finite weight; DivergenceError when it left a weight beyond
        --max_weight_growth, or after more than --max_zero_grad_steps exactly-zero gradients in a row."""
        opt = self._require_optimizer()
        if self._unsynced:
            raise RuntimeError("optimizer_step after backward(sync_grads=False): the last micro-batch "
                               "of an optimizer step must call backward(loss, sync_grads=True)")
        params = self._params()
        if self.guard.needs_start:  # max |w| before training changes the weights (once; kept in checkpoints)
            self.guard.measure_start(self._named_params(params))
        if self.loss_scaler is not None:
            inv = 1.0 / self.loss_scaler.scale
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(inv)
        several = self.is_sharded or D.get_world_size() > 1
        norm = step_grad_norm(opt, params, self.master, several, self.loss_scaler is not None)
        finite, loss_bad, norm_value = decide_and_step(opt, params, norm, self.guard, self.optim_cfg.max_norm,
                                                       several, self.loss_scaler is not None)
        lr = self.lr
        if lr == 0 and self.scheduler.last_epoch == 0 and self.optim_cfg.learning_rate > 0:
            note_once(f"note: optimizer step 1 trains at learning rate 0: the linear warm-up (--lr_warmup_ratio "
                      f"{self.optim_cfg.lr_warmup_ratio:g}) starts from 0, as Hugging Face's schedules do; "
                      "--lr_warmup_ratio 0 starts at the peak")
        # under fp16 a finite loss with overflowing gradients is the loss scale's business
        counts = not finite and (self.loss_scaler is None or loss_bad
                                 or self.loss_scaler.scale <= self.loss_scaler.min_scale)
        if self.loss_scaler is not None:
            self.loss_scaler.update(finite)
        if finite:
            opt.zero_grad(set_to_none=True)
            self.guard.check_weights_later(self._named_params(params), f"after optimizer step {self.guard.steps} "
                                           f"(grad norm {norm_value:.4g}, learning rate {lr:g})",
                                           flag=getattr(opt, "weights_bad", None))
            self.guard.stepped(norm_value, lr)
            if self.master is not None and not getattr(opt, "wrote_module", False):
                self.master.copy_to_model()
            if self.ema is not None:
                self.ema.update()
            self.scheduler.step()
        else:
            opt.zero_grad(set_to_none=True)
            self.guard.skip(counts, norm_value, lr)
        return {"grad_norm": norm_value, "lr": lr, "skipped": 0.0 if finite else 1.0,
                "nonfinite_skipped": 1.0 if counts else 0.0}

    def _named_params(self, params: list[nn.Parameter]) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the optimizer's parameters (the fp32 masters under master weights), cached."""
        key = tuple(map(id, params))
        if self._named_cache is None or self._named_cache[0] != key:
            names = {id(p): n for n, p in self.model.named_parameters()}
            if self.master is not None:
                names.update({id(m): n for n, m in zip(self.master.names, self.master.masters)})
            self._named_cache = (key, [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)])
        return self._named_cache[1]

    def check_finite(self, what: str) -> None:
        """Raise NonFiniteError if a trainable weight is NaN or infinite, DivergenceError if one has grown
        past --max_weight_growth (all ranks call)."""
        if self.guard is not None:
            self._wake()
            self.guard.resolve()
            self.guard.check_weights(self._named_params(self._params()), what)

    # ------------------------------------------------------------------ weights out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict on rank 0 (`{}` elsewhere); all ranks call. May alias CPU params."""
        self._wake()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.master is not None:
            return self.master.model_state_dict(self.model)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """Full optimizer state keyed by parameter name, on CPU (rank 0 holds it; all ranks call)."""
        self._wake()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opt = self._require_optimizer()
        if self.master is not None:
            return self.master.optimizer_state_dict(opt)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, opt, options=opts)

    def load_full_state(self, model_sd: dict[str, torch.Tensor], optim_sd: dict[str, Any] | None) -> None:
        """Load a full model (and optimizer) state; when sharded, rank 0's copy is broadcast."""
        self._wake()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        if self.master is not None:
            self.master.load_model_state_dict(self.model, model_sd)
            if optim_sd is not None:
                self.master.load_optimizer_state_dict(self._require_optimizer(), optim_sd)
            return
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.is_sharded)
        set_model_state_dict(self.model, model_sd, options=opts)
        if optim_sd is not None:
            set_optimizer_state_dict(self.model, self._require_optimizer(), optim_sd, options=opts)

    def named_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) pairs for weight sync, gathered one at a time; all ranks iterate. Raises
        NonFiniteError if the last optimizer step left a non-finite weight (guard.py), before
        anything is gathered."""
        self._wake()
        if self.guard is not None:
            self.guard.resolve()
        yield from iter_full_params(self.model, dtype)

    def save_hf(self, path: str, tokenizer: Any = None, dtype: torch.dtype | None = None,
                max_shard_size: int | str | None = None) -> None:
        """HF directory; weights in `dtype` (default `self.save_dtype`: the base model's), streamed one tensor
        at a time into safetensors files of at most `max_shard_size` (default --hf_max_shard_size); the
        EMA weights under --enable_ema. All ranks call; rank 0 writes."""
        limit = parse_size(self.cfg.hf_max_shard_size if max_shard_size is None else max_shard_size)
        self.check_finite(f"refusing to write {path}")
        sync = self.master.copy_to_model if self.master is not None else None
        with self.ema.swapped_in(sync) if self.ema is not None else contextlib.nullcontext():  # --enable_ema
            export_hf(self.unwrap(), path, dtype or self.save_dtype, limit, tokenizer,
                      master_of=self.master.master_or_none if self.master is not None else None,
                      full_state_dict=self.full_state_dict)

    # ------------------------------------------------------------------ checkpoints

    def trainer_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                "guard": self.guard.state_dict() if self.guard else None}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None and state.get("scheduler") is not None:
            peak = list(self.scheduler.base_lrs)
            self.scheduler.load_state_dict(state["scheduler"])
            # the position comes from the checkpoint; the peak rates are this run's (--learning_rate,
            # the same unless changed with --allow_resume_changes), as is the schedule's shape
            self.scheduler.base_lrs = peak
            step = self.scheduler.last_epoch
            rates = [base * fn(step) for base, fn in zip(peak, self.scheduler.lr_lambdas)]
            self.scheduler._last_lr = rates  # what get_last_lr() reports
            # the rate of the next step (also when the checkpoint had no optimizer state to carry it)
            for group, lr in zip(self.optimizer.param_groups, rates):
                group["lr"] = lr
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if self.guard is not None:  # the start of training's max |w| (--max_weight_growth)
            self.guard.load_state_dict(state.get("guard") or {})

    @property
    def optimizer_has_state(self) -> bool:
        """False until the first optimizer step (nothing to save for the optimizer yet)."""
        return bool(self._require_optimizer().state)

    def sharded_state_dict(self, with_optimizer: bool = True, with_ema: bool = True) -> dict[str, Any]:
        """{"model": ..., "optim": ..., "ema": ...} of this rank: DTensor shards when sharded (in one
        process the module's tensors, with the fp32 masters in place of low-precision parameters);
        optimizer state keyed by parameter name; the EMA weights under --enable_ema. Live tensors, no
        gather: torch.distributed.checkpoint writes from them and loads into them in place. A fresh
        optimizer is given zero state to load into."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        opt = self._require_optimizer()
        if self.master is not None:
            sd = {"model": self.master.live_model_state_dict(self.model)}
            if with_optimizer:
                sd["optim"] = self.master.live_optimizer_state_dict(opt)
        else:
            sd = {"model": get_model_state_dict(self.model)}
            if with_optimizer:
                sd["optim"] = get_optimizer_state_dict(self.model, opt)
        sd["model"] = without_four_bit(sd["model"], self.four_bit)
        if self.ema is not None and with_ema:
            sd["ema"] = self.ema.state_dict()
        return sd

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """Apply a `sharded_state_dict()` that a checkpoint was loaded into; without "optim" the
        optimizer starts fresh (the checkpoint was taken before its first step)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        opt = self._require_optimizer()
        if self.master is not None:
            self.master.copy_to_model()  # the masters were loaded in place
            if "optim" in sd:
                self.master.load_optimizer_state_dict(opt, sd["optim"])
        else:
            _set_model_state(self.model, sd["model"], self.four_bit)
            if "optim" in sd:
                set_optimizer_state_dict(self.model, opt, sd["optim"])
        if "optim" not in sd:
            opt.state.clear()
        if self.ema is not None:
            if "ema" in sd:
                self.ema.load_state_dict(sd["ema"])
            else:  # a checkpoint of a run without --enable_ema: the average starts at the loaded weights
                note_once("note: --enable_ema: the checkpoint has no EMA weights; the average starts at its weights")
                self.ema = EMAWeights(self._named_params(self._params()), self.ema.beta)

    def save_checkpoint(self, ckpt_root: str, tag: str, client_state: dict | None,
                        max_keep: int) -> str:
        self._require_optimizer()
        self.check_finite(f"refusing to write checkpoint {tag} under {ckpt_root}")
        return ckpt.save_checkpoint(self, ckpt_root, tag, client_state, max_keep)

    def load_checkpoint(self, ckpt_root: str, tag: str | None = None) -> dict | None:
        self._require_optimizer()
        return ckpt.load_checkpoint(self, ckpt_root, tag)


def _set_model_state(model: nn.Module, sd: dict[str, Any], four_bit: frozenset[str]) -> None:
    """`set_model_state_dict`; a model with a 4-bit base (whose entries checkpoints leave out) loads the rest,
    and anything else missing is still an error."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not four_bit:
        set_model_state_dict(model, sd)
        return
    missing, unexpected = set_model_state_dict(model, sd, options=StateDictOptions(strict=False))
    missing = [k for k in missing if not is_four_bit_key(k, four_bit)]
    if missing or unexpected:
        raise RuntimeError(f"the checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
