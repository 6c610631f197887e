"""The Python API configs' fields: one dataclass per command, one typed, documented field per flag.

Generated from the commands' flag tables by `python -m rlhfkit.api.gen_fields`; do not edit by hand
(tests/unit/test_api_fields.py checks that it is up to date). The configs users build
(rlhfkit.api.offline, rlhfkit.api.rl) subclass these; rlhfkit.api.config has their behaviour.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import ClassVar, Literal

from rlhfkit.api.config import FlagConfig, trl_names


@trl_names
@dataclass(repr=False, kw_only=True)
class TrainSFTFields(FlagConfig):
    """The flags of `python -m rlhfkit.cli.train_sft` as fields, with its defaults; the inputs
    (--pretrain, --dataset, --eval_dataset) are the trainer's arguments."""

    COMMAND: ClassVar[str] = "train_sft"
    INPUTS: ClassVar[tuple[str, ...]] = ("pretrain", "dataset", "eval_dataset")

    # general
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """console messages from this level up (debug: also transformers' info messages and third-party progress bars);
    the run directory's train.log gets every level [--log_level]"""
    verbose: bool = False
    """also print third-party messages on the console: transformers' load reports and warnings, other packages'
    FutureWarnings and warnings, their progress bars (without it they go to train.log only; errors always show)
    [--verbose]"""

    # train_sft options
    multiturn: bool = False
    """--input_key holds a conversation; the loss covers every assistant turn [--multiturn, --data.multiturn]"""
    pretrain_mode: bool = False
    """loss on every token of the raw text (no template; continued pretraining) [--pretrain_mode,
    --model.pretrain_mode_enable]"""

    # model
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """compute dtype on GPU (master weights stay fp32); CPU training computes in fp32 [--param_dtype,
    --ds.param_dtype, --fsdp.param_dtype; --bf16 sets "bf16"]"""
    attn_implementation: str = "sdpa"
    """attention kernel of transformers: sdpa, eager, flash_attention_2 (when installed) [--attn_implementation,
    --ds.attn_implementation, --fsdp.attn_implementation; --flash_attn sets "flash_attention_2"]"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about a third more compute
    [--gradient_checkpointing, --model.gradient_checkpointing_enable, --actor.gradient_checkpointing_enable]"""
    mixed_precision: Literal["master_weights", "autocast"] = "master_weights"
    """one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 copies in the
    optimizer) or autocast (fp32 module under torch.autocast) [--mixed_precision]"""
    torch_compile: bool = False
    """torch.compile each transformer block of trained models [--torch_compile]"""
    gradient_checkpointing_use_reentrant: bool = False
    """with --gradient_checkpointing: torch's reentrant checkpoint variant (the default is the non-reentrant one)
    [--gradient_checkpointing_use_reentrant, --model.gradient_checkpointing_reentrant,
    --actor.gradient_checkpointing_reentrant]"""
    disable_fast_tokenizer: bool = False
    """load the slow (Python) tokenizer instead of the fast (Rust) one [--disable_fast_tokenizer,
    --data.disable_fast_tokenizer]"""
    use_liger_kernel: bool = False
    """OpenRLHF: Liger's fused kernels; no effect in train_sft: Liger kernels are not used; the log-prob kernel is
    fused already (rlhfkit.models.fused_logprobs) [--use_liger_kernel, --ds.use_liger_kernel]"""
    aux_loss_coef: float = 0.0
    """weight of a mixture-of-experts model's router load-balancing loss (0: off) [--aux_loss_coef,
    --model.aux_loss_coef, --actor.aux_loss_coef]"""
    experts_implementation: str | None = None
    """mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm (default: the model's
    own) [--experts_implementation, --ds.experts_implementation]"""
    use_ms: bool = False
    """download model ids from ModelScope (needs modelscope) [--use_ms]"""
    freeze_visual_encoder: bool = False
    """vision-language models: the vision tower does not train (nor go to the rollout engines); the language model
    and its head do [--freeze_visual_encoder, --actor.freeze_visual_encoder]"""

    # LoRA / QLoRA
    lora_rank: int = 0
    """rank of LoRA adapters on the trained model (0: train all weights); the saved model is the adapter (peft
    format) [--lora_rank, --ds.lora.rank]"""
    lora_alpha: int = 16
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank [--lora_alpha, --ds.lora.alpha]"""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """module names that get LoRA adapters (peft's target_modules; all-linear: every linear layer but the output
    head) [--target_modules, --ds.lora.target_modules]"""
    lora_dropout: float = 0.0
    """dropout probability on the LoRA adapters' input [--lora_dropout, --ds.lora.dropout]"""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base weights in 4-bit NF4 (needs bitsandbytes and CUDA; use with --lora_rank)
    [--load_in_4bit, --ds.load_in_4bit]"""

    # data
    dataset_probs: str | None = None
    """comma-separated sampling probabilities, one per --dataset entry (default: concatenate) [--dataset_probs,
    --data.dataset_probs]"""
    dataset_split: str = "train"
    """split of --dataset to read (for datasets with splits) [--dataset_split, --data.dataset_split, --train_split]"""
    input_key: str = "input"
    """column with the prompt (or the whole text / conversation) [--input_key, --data.input_key]"""
    output_key: str | None = None
    """column with the response (see the command's description) [--output_key, --data.output_key]"""
    input_template: str | None = None
    """format of the prompt with one {} for the --input_key text (default, or '': the text as it is)
    [--input_template, --data.input_template]"""
    apply_chat_template: bool = False
    """format prompts and conversations with the tokenizer's chat template (off: one line says when the tokenizer
    has one) [--apply_chat_template, --data.apply_chat_template]"""
    tokenizer_chat_template: str | None = None
    """a Jinja chat template that replaces the tokenizer's own [--tokenizer_chat_template,
    --data.tokenizer_chat_template]"""
    max_len: int = 2048
    """longest sample in tokens; longer samples are dropped (counted and reported) [--max_len, --data.max_len]"""
    max_samples: int = 1000000
    """read at most this many rows of the data (after mixing) [--max_samples, --data.max_samples]"""
    max_row_bytes: int = 1000000
    """largest input row in bytes; a larger row is an error naming file and row [--max_row_bytes,
    --data.max_row_bytes]"""
    dataloader_num_workers: int = 0
    """OpenRLHF: DataLoader worker processes; no effect in train_sft: data is tokenized once up front and batched in
    the training process (no loader workers) [--dataloader_num_workers, --data.dataloader_num_workers]"""
    image_key: str = "images"
    """column with a row's pictures: file paths, http(s) URLs, base64 data URIs or image bytes (one, or a list)
    [--image_key, --data.image_key]"""
    max_images_per_prompt: int = 0
    """> 0 turns on vision-language mode: pictures of --image_key go with each sample, at most this many (a row with
    more is an error) [--max_images_per_prompt, --data.max_images_per_prompt]"""
    image_failure: Literal["stop", "drop"] = "stop"
    """a missing, unreadable or too large picture: stop with an error naming file and row, or drop its row (counted)
    [--image_failure]"""
    max_image_bytes: int = 33554432
    """largest picture file in bytes [--max_image_bytes]"""
    max_image_pixels: int = 16777216
    """largest picture in pixels (width x height) [--max_image_pixels]"""

    # training
    train_batch_size: int = 128
    """global samples per optimizer step (all ranks together; gradient accumulation makes up the rest)
    [--train_batch_size, --train.batch_size]"""
    micro_train_batch_size: int = 8
    """samples per forward/backward pass on each rank [--micro_train_batch_size, --train.micro_batch_size]"""
    max_epochs: int = 2
    """passes over the data [--max_epochs, --train.max_epochs]"""
    seed: int = 42
    """seed of python, numpy, torch and data shuffling [--seed, --train.seed]"""
    full_determinism: bool = False
    """deterministic torch algorithms (transformers.enable_full_determinism): reproducible, slower
    [--full_determinism, --train.full_determinism_enable]"""
    max_steps: int | None = None
    """optimizer steps to take, cycling the data as often as needed (overrides --max_epochs) [--max_steps]"""

    # optimizer
    learning_rate: float = 5e-06
    """peak learning rate [--learning_rate, --adam.lr]"""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW beta1 beta2 [--adam_betas, --adam.betas]"""
    adam_eps: float = 1e-08
    """AdamW epsilon [--adam_eps, --adam.eps]"""
    l2: float = 0.0
    """AdamW weight decay [--l2, --adam.weight_decay]"""
    optim: Literal["adam", "adamw_8bit", "muon"] = "adam"
    """optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value (blockwise float8
    codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights of hidden layers, AdamW for
    the rest [--optim]"""
    master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = "fp32"
    """trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic: bf16 weights and
    gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same with a bf16 compensation of
    the rounding error (2 more bytes a parameter). The bf16 modes need --param_dtype bf16 and --optim adam or
    adamw_8bit [--master_weights]"""
    muon_lr: float = 0.02
    """Muon learning rate (--optim muon) [--muon_lr, --muon.lr]"""
    muon_momentum: float = 0.95
    """Muon momentum [--muon_momentum, --muon.momentum]"""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalise the update [--muon_ns_steps, --muon.ns_steps]"""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum (default) [--muon_nesterov, --muon.nesterov; --muon_no_nesterov sets False]"""
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr"] = "cosine_with_min_lr"
    """learning-rate schedule (transformers.get_scheduler), after a linear warm-up from 0 [--lr_scheduler]"""
    lr_warmup_ratio: float = 0.03
    """fraction of the optimizer steps spent warming up linearly from 0 [--lr_warmup_ratio]"""
    min_lr_ratio: float = 0.1
    """cosine_with_min_lr, cosine_warmup_with_min_lr: the learning rate ends at this fraction of the peak
    [--min_lr_ratio]"""
    max_norm: float = 1.0
    """clip the gradient's global L2 norm to this (0 disables) [--max_norm]"""
    max_nonfinite_steps: int = 3
    """optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row (or a non-finite
    weight) stop the run with exit code 1, nothing saved [--max_nonfinite_steps]"""
    max_weight_growth: float = 100.0
    """a trainable weight whose magnitude exceeds this many times the largest at the start of training (at least 1)
    stops the run with exit code 1, nothing saved (0: off) [--max_weight_growth]"""
    max_zero_grad_steps: int = 3
    """more than this many optimizer steps in a row whose gradient is exactly 0 while the loss is not (a saturated
    model) stop the run with exit code 1, nothing saved (-1: off) [--max_zero_grad_steps]"""

    # evaluation
    eval_split: str = "train"
    """split of --eval_dataset to read [--eval_split, --eval.split]"""
    eval_steps: int = -1
    """evaluate every N steps (-1: once per epoch) [--eval_steps, --eval.steps]"""

    # checkpoints and output
    save_path: str = "./ckpt"
    """where the final model is saved in Hugging Face format [--save_path, --ckpt.output_dir]"""
    run_dir: str | None = None
    """metrics.jsonl, run_config.json and plots (default: --save_path) [--run_dir]"""
    overwrite_output_dir: bool = False
    """start over in a --save_path / --run_dir holding an earlier run: its metrics, run_config.json and the
    checkpoints inside it are removed (without it such a folder is refused) [--overwrite_output_dir,
    --ckpt.overwrite_output_dir]"""
    save_steps: int = -1
    """save a resumable checkpoint every N optimizer steps (-1: never) [--save_steps, --ckpt.save_steps]"""
    ckpt_path: str | None = None
    """folder of the resumable checkpoints (global_step<N>); default: <run dir>/checkpoints [--ckpt_path,
    --ckpt.path]"""
    max_ckpt_num: int = 3
    """keep this many newest checkpoints; older ones are deleted [--max_ckpt_num, --ckpt.max_num]"""
    max_ckpt_mem: float = 100000000.0
    """GB the resumable checkpoints in --ckpt_path may hold: after a save the oldest are deleted while they hold
    more (the one just saved always stays); as OpenRLHF's [--max_ckpt_mem, --ckpt.max_mem]"""
    load_checkpoint: bool = False
    """resume from the newest intact checkpoint in --ckpt_path, if there is one (none, and the output folders hold
    an earlier run: an error); its run's model, data, batch and learning-rate settings must be this run's
    [--load_checkpoint, --ckpt.load_enable]"""
    allow_resume_changes: str | None = None
    """--load_checkpoint: accept these settings (comma-separated flag names, or all) differing from the checkpoint's
    run as deliberate changes [--allow_resume_changes]"""
    save_hf_ckpt: bool = False
    """also save a Hugging Face snapshot with each checkpoint (<ckpt_path>/global_step<N>_hf) [--save_hf_ckpt,
    --ckpt.save_hf]"""
    hf_max_shard_size: str = "5GB"
    """largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes [--hf_max_shard_size]"""
    save_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """dtype of the saved Hugging Face model (auto: the dtype --pretrain's folder stores, else the compute dtype)
    [--save_dtype]"""
    disable_ds_ckpt: bool = False
    """--save_steps writes no resumable checkpoint (only --save_hf_ckpt snapshots) [--disable_ds_ckpt,
    --ckpt.disable_ds]"""
    stop_grace_s: float = 10.0
    """on SIGINT / SIGTERM the current step may finish within this many seconds (else it is abandoned); then a
    resumable checkpoint is written, the resume command printed, exit 130 / 143 [--stop_grace_s]"""

    # logging
    logging_steps: int = 1
    """log metrics every N optimizer steps [--logging_steps, --logger.logging_steps]"""
    use_wandb: str | None = None
    """log to Weights & Biases: an API key, or 'True' to use the logged-in account [--use_wandb, --logger.wandb.key]"""
    wandb_org: str | None = None
    """wandb entity (team or user) [--wandb_org, --logger.wandb.org]"""
    wandb_group: str | None = None
    """wandb run group [--wandb_group, --logger.wandb.group]"""
    wandb_project: str = "rlhfkit_train_sft"
    """wandb project [--wandb_project, --logger.wandb.project]"""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb's), also the TensorBoard run's folder under --use_tensorboard
    [--wandb_run_name, --logger.wandb.run_name]"""
    use_tensorboard: str | None = None
    """write TensorBoard event files to <this folder>/<run name>: --wandb_run_name, else the run directory's name
    and the start time (needs tensorboard) [--use_tensorboard, --logger.tensorboard_dir]"""
    disable_progress: bool = False
    """no progress bar [--disable_progress]"""

    # distributed backend
    backend: Literal["fsdp2", "deepspeed"] = "fsdp2"
    """training backend (fsdp2: PyTorch FSDP2, nothing extra to install) [--backend]"""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """sharding over data-parallel ranks, in DeepSpeed ZeRO terms: 0 replicate; 1/2 shard gradients and optimizer
    states; 3 shard the weights too [--zero_stage, --ds.zero_stage]"""
    local_rank: int = -1
    """OpenRLHF: this process's rank on its node; no effect in train_sft: each process reads its rank from the
    environment (LOCAL_RANK / RANK, set by torchrun and the deepspeed launcher) [--local_rank]"""
    adam_offload: bool = False
    """keep optimizer states and fp32 master weights in host memory (CUDA only) [--adam_offload, --ds.adam_offload]"""
    packing_samples: bool = False
    """pack several samples into one row without padding (attention kept within each sample) [--packing_samples,
    --ds.packing_samples]"""
    ring_attn_size: int = 1
    """context parallelism: each sequence is split over this many ranks, whose attention passes key/value blocks
    round a ring (must divide the world size; 1: off) [--ring_attn_size, --ds.ring_attn_size]"""
    ring_head_stride: int = 1
    """key/value heads that go round the ring together with --ring_attn_size > 1 (must divide the model's key/value
    heads; larger: fewer, bigger ring passes) [--ring_head_stride, --ds.ring_attn_head_stride]"""
    ds_tensor_parallel_size: int = 1
    """tensor-parallel training size: attention heads, MLP and vocabulary split over this many ranks (Llama,
    Qwen2/3, Mistral), FSDP over the rest of the world [--ds_tensor_parallel_size, --ds.tensor_parallel_size]"""
    zpg: int = 1
    """OpenRLHF: ZeRO++ hierarchical partition size; no effect in train_sft: a DeepSpeed setting; the FSDP2 backend
    has no equivalent [--zpg, --ds.zpg]"""
    overlap_comm: bool = False
    """OpenRLHF: overlap DeepSpeed's gradient reduction with the backward pass; no effect in train_sft: a DeepSpeed
    setting; the FSDP2 backend has no equivalent [--overlap_comm, --ds.overlap_comm]"""
    grad_accum_dtype: str | None = None
    """OpenRLHF: DeepSpeed's gradient accumulation dtype; no effect in train_sft: a DeepSpeed setting; the FSDP2
    backend has no equivalent [--grad_accum_dtype, --ds.grad_accum_dtype]"""
    deepcompile: bool = False
    """OpenRLHF: DeepSpeed's DeepCompile; no effect in train_sft: a DeepSpeed setting; the FSDP2 backend has no
    equivalent [--deepcompile, --ds.deepcompile]"""
    use_universal_ckpt: bool = False
    """OpenRLHF: load DeepSpeed universal checkpoints; no effect in train_sft: checkpoints
    (torch.distributed.checkpoint) load on any number of ranks without conversion [--use_universal_ckpt,
    --ds.use_universal_ckpt, --use_ds_universal_ckpt]"""
    device: str | None = None
    """cpu or cuda (default: cuda when available) [--device]"""

    # Hugging Face TRL's names for the same settings (init-only; reading one reads ours)
    output_dir: InitVar[str | None] = None
    """TRL's name for `save_path`"""
    per_device_train_batch_size: InitVar[int | None] = None
    """TRL's name for `micro_train_batch_size`"""


@trl_names
@dataclass(repr=False, kw_only=True)
class TrainRMFields(FlagConfig):
    """The flags of `python -m rlhfkit.cli.train_rm` as fields, with its defaults; the inputs
    (--pretrain, --dataset, --eval_dataset) are the trainer's arguments."""

    COMMAND: ClassVar[str] = "train_rm"
    INPUTS: ClassVar[tuple[str, ...]] = ("pretrain", "dataset", "eval_dataset")

    # general
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """console messages from this level up (debug: also transformers' info messages and third-party progress bars);
    the run directory's train.log gets every level [--log_level]"""
    verbose: bool = False
    """also print third-party messages on the console: transformers' load reports and warnings, other packages'
    FutureWarnings and warnings, their progress bars (without it they go to train.log only; errors always show)
    [--verbose]"""

    # train_rm options
    value_head_prefix: str = "score"
    """name of the value head module (score: loadable by AutoModelForSequenceClassification) [--value_head_prefix,
    --ds.value_head_prefix, --value_prefix_head]"""
    loss: Literal["sigmoid", "logexp"] = "sigmoid"
    """sigmoid: -log sigmoid(r_c - r_r - margin); logexp: log(1 + exp(r_r - r_c)) [--loss, --model.loss_type]"""
    margin_loss: bool = False
    """subtract each row's `margin` column inside the sigmoid loss [--margin_loss, --model.margin_loss_enable]"""
    compute_fp32_loss: bool = False
    """accepted for OpenRLHF command lines; no effect in train_rm: rewards and the loss are always computed in fp32
    [--compute_fp32_loss, --model.compute_fp32_loss_enable]"""

    # model
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """compute dtype on GPU (master weights stay fp32); CPU training computes in fp32 [--param_dtype,
    --ds.param_dtype, --fsdp.param_dtype; --bf16 sets "bf16"]"""
    attn_implementation: str = "sdpa"
    """attention kernel of transformers: sdpa, eager, flash_attention_2 (when installed) [--attn_implementation,
    --ds.attn_implementation, --fsdp.attn_implementation; --flash_attn sets "flash_attention_2"]"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about a third more compute
    [--gradient_checkpointing, --model.gradient_checkpointing_enable, --actor.gradient_checkpointing_enable]"""
    mixed_precision: Literal["master_weights", "autocast"] = "master_weights"
    """one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 copies in the
    optimizer) or autocast (fp32 module under torch.autocast) [--mixed_precision]"""
    torch_compile: bool = False
    """torch.compile each transformer block of trained models [--torch_compile]"""
    gradient_checkpointing_use_reentrant: bool = False
    """with --gradient_checkpointing: torch's reentrant checkpoint variant (the default is the non-reentrant one)
    [--gradient_checkpointing_use_reentrant, --model.gradient_checkpointing_reentrant,
    --actor.gradient_checkpointing_reentrant]"""
    disable_fast_tokenizer: bool = False
    """load the slow (Python) tokenizer instead of the fast (Rust) one [--disable_fast_tokenizer,
    --data.disable_fast_tokenizer]"""
    use_liger_kernel: bool = False
    """OpenRLHF: Liger's fused kernels; no effect in train_rm: Liger kernels are not used; the log-prob kernel is
    fused already (rlhfkit.models.fused_logprobs) [--use_liger_kernel, --ds.use_liger_kernel]"""
    aux_loss_coef: float = 0.0
    """weight of a mixture-of-experts model's router load-balancing loss (0: off) [--aux_loss_coef,
    --model.aux_loss_coef, --actor.aux_loss_coef]"""
    experts_implementation: str | None = None
    """mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm (default: the model's
    own) [--experts_implementation, --ds.experts_implementation]"""
    use_ms: bool = False
    """download model ids from ModelScope (needs modelscope) [--use_ms]"""

    # LoRA / QLoRA
    lora_rank: int = 0
    """rank of LoRA adapters on the trained model (0: train all weights); the saved model is the adapter (peft
    format) [--lora_rank, --ds.lora.rank]"""
    lora_alpha: int = 16
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank [--lora_alpha, --ds.lora.alpha]"""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """module names that get LoRA adapters (peft's target_modules; all-linear: every linear layer but the output
    head) [--target_modules, --ds.lora.target_modules]"""
    lora_dropout: float = 0.0
    """dropout probability on the LoRA adapters' input [--lora_dropout, --ds.lora.dropout]"""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base weights in 4-bit NF4 (needs bitsandbytes and CUDA; use with --lora_rank)
    [--load_in_4bit, --ds.load_in_4bit]"""

    # data
    dataset_probs: str | None = None
    """comma-separated sampling probabilities, one per --dataset entry (default: concatenate) [--dataset_probs,
    --data.dataset_probs]"""
    dataset_split: str = "train"
    """split of --dataset to read (for datasets with splits) [--dataset_split, --data.dataset_split, --train_split]"""
    input_key: str = "input"
    """column with the prompt (or the whole text / conversation); no effect in train_rm: pairs are read from
    --prompt_key, --chosen_key and --rejected_key [--input_key, --data.input_key]"""
    output_key: str | None = None
    """column with the response (see the command's description); no effect in train_rm: pairs are read from
    --prompt_key, --chosen_key and --rejected_key [--output_key, --data.output_key]"""
    input_template: str | None = None
    """format of the prompt with one {} for the --input_key text (default, or '': the text as it is)
    [--input_template, --data.input_template]"""
    apply_chat_template: bool = False
    """format prompts and conversations with the tokenizer's chat template (off: one line says when the tokenizer
    has one) [--apply_chat_template, --data.apply_chat_template]"""
    tokenizer_chat_template: str | None = None
    """a Jinja chat template that replaces the tokenizer's own [--tokenizer_chat_template,
    --data.tokenizer_chat_template]"""
    max_len: int = 512
    """longest sample in tokens; longer samples are dropped (counted and reported) [--max_len, --data.max_len]"""
    max_samples: int = 1000000
    """read at most this many rows of the data (after mixing) [--max_samples, --data.max_samples]"""
    max_row_bytes: int = 1000000
    """largest input row in bytes; a larger row is an error naming file and row [--max_row_bytes,
    --data.max_row_bytes]"""
    dataloader_num_workers: int = 0
    """OpenRLHF: DataLoader worker processes; no effect in train_rm: data is tokenized once up front and batched in
    the training process (no loader workers) [--dataloader_num_workers, --data.dataloader_num_workers]"""
    prompt_key: str | None = None
    """prompt column; without it chosen/rejected are whole texts or conversations [--prompt_key, --data.prompt_key]"""
    chosen_key: str = "chosen"
    """column with the preferred answer (or whole text / conversation) [--chosen_key, --data.chosen_key]"""
    rejected_key: str = "rejected"
    """column with the dispreferred answer (or whole text / conversation) [--rejected_key, --data.rejected_key]"""

    # training
    train_batch_size: int = 128
    """global samples per optimizer step (all ranks together; gradient accumulation makes up the rest)
    [--train_batch_size, --train.batch_size]"""
    micro_train_batch_size: int = 1
    """samples per forward/backward pass on each rank [--micro_train_batch_size, --train.micro_batch_size]"""
    max_epochs: int = 1
    """passes over the data [--max_epochs, --train.max_epochs]"""
    seed: int = 42
    """seed of python, numpy, torch and data shuffling [--seed, --train.seed]"""
    full_determinism: bool = False
    """deterministic torch algorithms (transformers.enable_full_determinism): reproducible, slower
    [--full_determinism, --train.full_determinism_enable]"""
    max_steps: int | None = None
    """optimizer steps to take, cycling the data as often as needed (overrides --max_epochs) [--max_steps]"""

    # optimizer
    learning_rate: float = 9e-06
    """peak learning rate [--learning_rate, --adam.lr]"""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW beta1 beta2 [--adam_betas, --adam.betas]"""
    adam_eps: float = 1e-08
    """AdamW epsilon [--adam_eps, --adam.eps]"""
    l2: float = 0.0
    """AdamW weight decay [--l2, --adam.weight_decay]"""
    optim: Literal["adam", "adamw_8bit", "muon"] = "adam"
    """optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value (blockwise float8
    codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights of hidden layers, AdamW for
    the rest [--optim]"""
    master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = "fp32"
    """trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic: bf16 weights and
    gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same with a bf16 compensation of
    the rounding error (2 more bytes a parameter). The bf16 modes need --param_dtype bf16 and --optim adam or
    adamw_8bit [--master_weights]"""
    muon_lr: float = 0.02
    """Muon learning rate (--optim muon) [--muon_lr, --muon.lr]"""
    muon_momentum: float = 0.95
    """Muon momentum [--muon_momentum, --muon.momentum]"""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalise the update [--muon_ns_steps, --muon.ns_steps]"""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum (default) [--muon_nesterov, --muon.nesterov; --muon_no_nesterov sets False]"""
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr"] = "cosine_with_min_lr"
    """learning-rate schedule (transformers.get_scheduler), after a linear warm-up from 0 [--lr_scheduler]"""
    lr_warmup_ratio: float = 0.03
    """fraction of the optimizer steps spent warming up linearly from 0 [--lr_warmup_ratio]"""
    min_lr_ratio: float = 0.1
    """cosine_with_min_lr, cosine_warmup_with_min_lr: the learning rate ends at this fraction of the peak
    [--min_lr_ratio]"""
    max_norm: float = 1.0
    """clip the gradient's global L2 norm to this (0 disables) [--max_norm]"""
    max_nonfinite_steps: int = 3
    """optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row (or a non-finite
    weight) stop the run with exit code 1, nothing saved [--max_nonfinite_steps]"""
    max_weight_growth: float = 100.0
    """a trainable weight whose magnitude exceeds this many times the largest at the start of training (at least 1)
    stops the run with exit code 1, nothing saved (0: off) [--max_weight_growth]"""
    max_zero_grad_steps: int = 3
    """more than this many optimizer steps in a row whose gradient is exactly 0 while the loss is not (a saturated
    model) stop the run with exit code 1, nothing saved (-1: off) [--max_zero_grad_steps]"""

    # evaluation
    eval_split: str = "train"
    """split of --eval_dataset to read [--eval_split, --eval.split]"""
    eval_steps: int = -1
    """evaluate every N steps (-1: once per epoch) [--eval_steps, --eval.steps]"""

    # checkpoints and output
    save_path: str = "./ckpt"
    """where the final model is saved in Hugging Face format [--save_path, --ckpt.output_dir]"""
    run_dir: str | None = None
    """metrics.jsonl, run_config.json and plots (default: --save_path) [--run_dir]"""
    overwrite_output_dir: bool = False
    """start over in a --save_path / --run_dir holding an earlier run: its metrics, run_config.json and the
    checkpoints inside it are removed (without it such a folder is refused) [--overwrite_output_dir,
    --ckpt.overwrite_output_dir]"""
    save_steps: int = -1
    """save a resumable checkpoint every N optimizer steps (-1: never) [--save_steps, --ckpt.save_steps]"""
    ckpt_path: str | None = None
    """folder of the resumable checkpoints (global_step<N>); default: <run dir>/checkpoints [--ckpt_path,
    --ckpt.path]"""
    max_ckpt_num: int = 3
    """keep this many newest checkpoints; older ones are deleted [--max_ckpt_num, --ckpt.max_num]"""
    max_ckpt_mem: float = 100000000.0
    """GB the resumable checkpoints in --ckpt_path may hold: after a save the oldest are deleted while they hold
    more (the one just saved always stays); as OpenRLHF's [--max_ckpt_mem, --ckpt.max_mem]"""
    load_checkpoint: bool = False
    """resume from the newest intact checkpoint in --ckpt_path, if there is one (none, and the output folders hold
    an earlier run: an error); its run's model, data, batch and learning-rate settings must be this run's
    [--load_checkpoint, --ckpt.load_enable]"""
    allow_resume_changes: str | None = None
    """--load_checkpoint: accept these settings (comma-separated flag names, or all) differing from the checkpoint's
    run as deliberate changes [--allow_resume_changes]"""
    save_hf_ckpt: bool = False
    """also save a Hugging Face snapshot with each checkpoint (<ckpt_path>/global_step<N>_hf) [--save_hf_ckpt,
    --ckpt.save_hf]"""
    hf_max_shard_size: str = "5GB"
    """largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes [--hf_max_shard_size]"""
    save_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """dtype of the saved Hugging Face model (auto: the dtype --pretrain's folder stores, else the compute dtype)
    [--save_dtype]"""
    disable_ds_ckpt: bool = False
    """--save_steps writes no resumable checkpoint (only --save_hf_ckpt snapshots) [--disable_ds_ckpt,
    --ckpt.disable_ds]"""
    stop_grace_s: float = 10.0
    """on SIGINT / SIGTERM the current step may finish within this many seconds (else it is abandoned); then a
    resumable checkpoint is written, the resume command printed, exit 130 / 143 [--stop_grace_s]"""

    # logging
    logging_steps: int = 1
    """log metrics every N optimizer steps [--logging_steps, --logger.logging_steps]"""
    use_wandb: str | None = None
    """log to Weights & Biases: an API key, or 'True' to use the logged-in account [--use_wandb, --logger.wandb.key]"""
    wandb_org: str | None = None
    """wandb entity (team or user) [--wandb_org, --logger.wandb.org]"""
    wandb_group: str | None = None
    """wandb run group [--wandb_group, --logger.wandb.group]"""
    wandb_project: str = "rlhfkit_train_rm"
    """wandb project [--wandb_project, --logger.wandb.project]"""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb's), also the TensorBoard run's folder under --use_tensorboard
    [--wandb_run_name, --logger.wandb.run_name]"""
    use_tensorboard: str | None = None
    """write TensorBoard event files to <this folder>/<run name>: --wandb_run_name, else the run directory's name
    and the start time (needs tensorboard) [--use_tensorboard, --logger.tensorboard_dir]"""
    disable_progress: bool = False
    """no progress bar [--disable_progress]"""

    # distributed backend
    backend: Literal["fsdp2", "deepspeed"] = "fsdp2"
    """training backend (fsdp2: PyTorch FSDP2, nothing extra to install) [--backend]"""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """sharding over data-parallel ranks, in DeepSpeed ZeRO terms: 0 replicate; 1/2 shard gradients and optimizer
    states; 3 shard the weights too [--zero_stage, --ds.zero_stage]"""
    local_rank: int = -1
    """OpenRLHF: this process's rank on its node; no effect in train_rm: each process reads its rank from the
    environment (LOCAL_RANK / RANK, set by torchrun and the deepspeed launcher) [--local_rank]"""
    adam_offload: bool = False
    """keep optimizer states and fp32 master weights in host memory (CUDA only) [--adam_offload, --ds.adam_offload]"""
    packing_samples: bool = False
    """pack several samples into one row without padding (attention kept within each sample) [--packing_samples,
    --ds.packing_samples]"""
    ring_attn_size: int = 1
    """context parallelism: each sequence is split over this many ranks, whose attention passes key/value blocks
    round a ring (must divide the world size; 1: off) [--ring_attn_size, --ds.ring_attn_size]"""
    ring_head_stride: int = 1
    """key/value heads that go round the ring together with --ring_attn_size > 1 (must divide the model's key/value
    heads; larger: fewer, bigger ring passes) [--ring_head_stride, --ds.ring_attn_head_stride]"""
    ds_tensor_parallel_size: int = 1
    """tensor-parallel training size: attention heads, MLP and vocabulary split over this many ranks (Llama,
    Qwen2/3, Mistral), FSDP over the rest of the world [--ds_tensor_parallel_size, --ds.tensor_parallel_size]"""
    zpg: int = 1
    """OpenRLHF: ZeRO++ hierarchical partition size; no effect in train_rm: a DeepSpeed setting; the FSDP2 backend
    has no equivalent [--zpg, --ds.zpg]"""
    overlap_comm: bool = False
    """OpenRLHF: overlap DeepSpeed's gradient reduction with the backward pass; no effect in train_rm: a DeepSpeed
    setting; the FSDP2 backend has no equivalent [--overlap_comm, --ds.overlap_comm]"""
    grad_accum_dtype: str | None = None
    """OpenRLHF: DeepSpeed's gradient accumulation dtype; no effect in train_rm: a DeepSpeed setting; the FSDP2
    backend has no equivalent [--grad_accum_dtype, --ds.grad_accum_dtype]"""
    deepcompile: bool = False
    """OpenRLHF: DeepSpeed's DeepCompile; no effect in train_rm: a DeepSpeed setting; the FSDP2 backend has no
    equivalent [--deepcompile, --ds.deepcompile]"""
    use_universal_ckpt: bool = False
    """OpenRLHF: load DeepSpeed universal checkpoints; no effect in train_rm: checkpoints
    (torch.distributed.checkpoint) load on any number of ranks without conversion [--use_universal_ckpt,
    --ds.use_universal_ckpt, --use_ds_universal_ckpt]"""
    device: str | None = None
    """cpu or cuda (default: cuda when available) [--device]"""

    # Hugging Face TRL's names for the same settings (init-only; reading one reads ours)
    output_dir: InitVar[str | None] = None
    """TRL's name for `save_path`"""
    per_device_train_batch_size: InitVar[int | None] = None
    """TRL's name for `micro_train_batch_size`"""


@trl_names
@dataclass(repr=False, kw_only=True)
class TrainDPOFields(FlagConfig):
    """The flags of `python -m rlhfkit.cli.train_dpo` as fields, with its defaults; the inputs
    (--pretrain, --dataset, --eval_dataset) are the trainer's arguments."""

    COMMAND: ClassVar[str] = "train_dpo"
    INPUTS: ClassVar[tuple[str, ...]] = ("pretrain", "dataset", "eval_dataset")

    # general
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """console messages from this level up (debug: also transformers' info messages and third-party progress bars);
    the run directory's train.log gets every level [--log_level]"""
    verbose: bool = False
    """also print third-party messages on the console: transformers' load reports and warnings, other packages'
    FutureWarnings and warnings, their progress bars (without it they go to train.log only; errors always show)
    [--verbose]"""

    # train_dpo options
    beta: float = 0.1
    """DPO temperature beta [--beta, --model.beta]"""
    ipo: bool = False
    """IPO loss: (z - 1 / (2 beta))^2 [--ipo, --model.ipo_enable]"""
    label_smoothing: float = 0.0
    """cDPO: probability that a preference label is flipped, in [0, 0.5] [--label_smoothing,
    --model.label_smoothing]"""
    nll_loss_coef: float = 0.0
    """weight of the chosen answers' NLL (Llama 3.1 / RPO style) [--nll_loss_coef, --model.nll_loss_coef]"""

    # model
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """compute dtype on GPU (master weights stay fp32); CPU training computes in fp32 [--param_dtype,
    --ds.param_dtype, --fsdp.param_dtype; --bf16 sets "bf16"]"""
    attn_implementation: str = "sdpa"
    """attention kernel of transformers: sdpa, eager, flash_attention_2 (when installed) [--attn_implementation,
    --ds.attn_implementation, --fsdp.attn_implementation; --flash_attn sets "flash_attention_2"]"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about a third more compute
    [--gradient_checkpointing, --model.gradient_checkpointing_enable, --actor.gradient_checkpointing_enable]"""
    mixed_precision: Literal["master_weights", "autocast"] = "master_weights"
    """one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 copies in the
    optimizer) or autocast (fp32 module under torch.autocast) [--mixed_precision]"""
    torch_compile: bool = False
    """torch.compile each transformer block of trained models [--torch_compile]"""
    gradient_checkpointing_use_reentrant: bool = False
    """with --gradient_checkpointing: torch's reentrant checkpoint variant (the default is the non-reentrant one)
    [--gradient_checkpointing_use_reentrant, --model.gradient_checkpointing_reentrant,
    --actor.gradient_checkpointing_reentrant]"""
    disable_fast_tokenizer: bool = False
    """load the slow (Python) tokenizer instead of the fast (Rust) one [--disable_fast_tokenizer,
    --data.disable_fast_tokenizer]"""
    use_liger_kernel: bool = False
    """OpenRLHF: Liger's fused kernels; no effect in train_dpo: Liger kernels are not used; the log-prob kernel is
    fused already (rlhfkit.models.fused_logprobs) [--use_liger_kernel, --ds.use_liger_kernel]"""
    aux_loss_coef: float = 0.0
    """weight of a mixture-of-experts model's router load-balancing loss (0: off) [--aux_loss_coef,
    --model.aux_loss_coef, --actor.aux_loss_coef]"""
    experts_implementation: str | None = None
    """mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm (default: the model's
    own) [--experts_implementation, --ds.experts_implementation]"""
    use_ms: bool = False
    """download model ids from ModelScope (needs modelscope) [--use_ms]"""
    ref_pretrain: str | None = None
    """reference model directory or hub id (default: --pretrain) [--ref_pretrain, --ref.model_name_or_path]"""
    ref_offload: bool = False
    """keep the reference model in CPU memory between its forward passes [--ref_offload, --ref.offload]"""
    freeze_visual_encoder: bool = False
    """vision-language models: the vision tower does not train (nor go to the rollout engines); the language model
    and its head do [--freeze_visual_encoder, --actor.freeze_visual_encoder]"""

    # LoRA / QLoRA
    lora_rank: int = 0
    """rank of LoRA adapters on the trained model (0: train all weights); the saved model is the adapter (peft
    format) [--lora_rank, --ds.lora.rank]"""
    lora_alpha: int = 16
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank [--lora_alpha, --ds.lora.alpha]"""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """module names that get LoRA adapters (peft's target_modules; all-linear: every linear layer but the output
    head) [--target_modules, --ds.lora.target_modules]"""
    lora_dropout: float = 0.0
    """dropout probability on the LoRA adapters' input [--lora_dropout, --ds.lora.dropout]"""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base weights in 4-bit NF4 (needs bitsandbytes and CUDA; use with --lora_rank)
    [--load_in_4bit, --ds.load_in_4bit]"""

    # data
    dataset_probs: str | None = None
    """comma-separated sampling probabilities, one per --dataset entry (default: concatenate) [--dataset_probs,
    --data.dataset_probs]"""
    dataset_split: str = "train"
    """split of --dataset to read (for datasets with splits) [--dataset_split, --data.dataset_split, --train_split]"""
    input_key: str = "input"
    """column with the prompt (or the whole text / conversation); no effect in train_dpo: pairs are read from
    --prompt_key, --chosen_key and --rejected_key [--input_key, --data.input_key]"""
    output_key: str | None = None
    """column with the response (see the command's description); no effect in train_dpo: pairs are read from
    --prompt_key, --chosen_key and --rejected_key [--output_key, --data.output_key]"""
    input_template: str | None = None
    """format of the prompt with one {} for the --input_key text (default, or '': the text as it is)
    [--input_template, --data.input_template]"""
    apply_chat_template: bool = False
    """format prompts and conversations with the tokenizer's chat template (off: one line says when the tokenizer
    has one) [--apply_chat_template, --data.apply_chat_template]"""
    tokenizer_chat_template: str | None = None
    """a Jinja chat template that replaces the tokenizer's own [--tokenizer_chat_template,
    --data.tokenizer_chat_template]"""
    max_len: int = 512
    """longest sample in tokens; longer samples are dropped (counted and reported) [--max_len, --data.max_len]"""
    max_samples: int = 1000000
    """read at most this many rows of the data (after mixing) [--max_samples, --data.max_samples]"""
    max_row_bytes: int = 1000000
    """largest input row in bytes; a larger row is an error naming file and row [--max_row_bytes,
    --data.max_row_bytes]"""
    dataloader_num_workers: int = 0
    """OpenRLHF: DataLoader worker processes; no effect in train_dpo: data is tokenized once up front and batched in
    the training process (no loader workers) [--dataloader_num_workers, --data.dataloader_num_workers]"""
    prompt_key: str | None = None
    """prompt column; without it chosen/rejected are whole texts or conversations [--prompt_key, --data.prompt_key]"""
    chosen_key: str = "chosen"
    """column with the preferred answer (or whole text / conversation) [--chosen_key, --data.chosen_key]"""
    rejected_key: str = "rejected"
    """column with the dispreferred answer (or whole text / conversation) [--rejected_key, --data.rejected_key]"""
    image_key: str = "images"
    """column with a row's pictures: file paths, http(s) URLs, base64 data URIs or image bytes (one, or a list)
    [--image_key, --data.image_key]"""
    max_images_per_prompt: int = 0
    """> 0 turns on vision-language mode: pictures of --image_key go with each sample, at most this many (a row with
    more is an error) [--max_images_per_prompt, --data.max_images_per_prompt]"""
    image_failure: Literal["stop", "drop"] = "stop"
    """a missing, unreadable or too large picture: stop with an error naming file and row, or drop its row (counted)
    [--image_failure]"""
    max_image_bytes: int = 33554432
    """largest picture file in bytes [--max_image_bytes]"""
    max_image_pixels: int = 16777216
    """largest picture in pixels (width x height) [--max_image_pixels]"""

    # training
    train_batch_size: int = 128
    """global samples per optimizer step (all ranks together; gradient accumulation makes up the rest)
    [--train_batch_size, --train.batch_size]"""
    micro_train_batch_size: int = 8
    """samples per forward/backward pass on each rank [--micro_train_batch_size, --train.micro_batch_size]"""
    max_epochs: int = 1
    """passes over the data [--max_epochs, --train.max_epochs]"""
    seed: int = 42
    """seed of python, numpy, torch and data shuffling [--seed, --train.seed]"""
    full_determinism: bool = False
    """deterministic torch algorithms (transformers.enable_full_determinism): reproducible, slower
    [--full_determinism, --train.full_determinism_enable]"""
    max_steps: int | None = None
    """optimizer steps to take, cycling the data as often as needed (overrides --max_epochs) [--max_steps]"""

    # optimizer
    learning_rate: float = 1e-05
    """peak learning rate [--learning_rate, --adam.lr]"""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW beta1 beta2 [--adam_betas, --adam.betas]"""
    adam_eps: float = 1e-08
    """AdamW epsilon [--adam_eps, --adam.eps]"""
    l2: float = 0.0
    """AdamW weight decay [--l2, --adam.weight_decay]"""
    optim: Literal["adam", "adamw_8bit", "muon"] = "adam"
    """optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value (blockwise float8
    codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights of hidden layers, AdamW for
    the rest [--optim]"""
    master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = "fp32"
    """trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic: bf16 weights and
    gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same with a bf16 compensation of
    the rounding error (2 more bytes a parameter). The bf16 modes need --param_dtype bf16 and --optim adam or
    adamw_8bit [--master_weights]"""
    muon_lr: float = 0.02
    """Muon learning rate (--optim muon) [--muon_lr, --muon.lr]"""
    muon_momentum: float = 0.95
    """Muon momentum [--muon_momentum, --muon.momentum]"""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalise the update [--muon_ns_steps, --muon.ns_steps]"""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum (default) [--muon_nesterov, --muon.nesterov; --muon_no_nesterov sets False]"""
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr"] = "cosine_with_min_lr"
    """learning-rate schedule (transformers.get_scheduler), after a linear warm-up from 0 [--lr_scheduler]"""
    lr_warmup_ratio: float = 0.03
    """fraction of the optimizer steps spent warming up linearly from 0 [--lr_warmup_ratio]"""
    min_lr_ratio: float = 0.1
    """cosine_with_min_lr, cosine_warmup_with_min_lr: the learning rate ends at this fraction of the peak
    [--min_lr_ratio]"""
    max_norm: float = 1.0
    """clip the gradient's global L2 norm to this (0 disables) [--max_norm]"""
    max_nonfinite_steps: int = 3
    """optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row (or a non-finite
    weight) stop the run with exit code 1, nothing saved [--max_nonfinite_steps]"""
    max_weight_growth: float = 100.0
    """a trainable weight whose magnitude exceeds this many times the largest at the start of training (at least 1)
    stops the run with exit code 1, nothing saved (0: off) [--max_weight_growth]"""
    max_zero_grad_steps: int = 3
    """more than this many optimizer steps in a row whose gradient is exactly 0 while the loss is not (a saturated
    model) stop the run with exit code 1, nothing saved (-1: off) [--max_zero_grad_steps]"""

    # evaluation
    eval_split: str = "test"
    """split of --eval_dataset to read [--eval_split, --eval.split]"""
    eval_steps: int = -1
    """evaluate every N steps (-1: once per epoch) [--eval_steps, --eval.steps]"""

    # checkpoints and output
    save_path: str = "./ckpt"
    """where the final model is saved in Hugging Face format [--save_path, --ckpt.output_dir]"""
    run_dir: str | None = None
    """metrics.jsonl, run_config.json and plots (default: --save_path) [--run_dir]"""
    overwrite_output_dir: bool = False
    """start over in a --save_path / --run_dir holding an earlier run: its metrics, run_config.json and the
    checkpoints inside it are removed (without it such a folder is refused) [--overwrite_output_dir,
    --ckpt.overwrite_output_dir]"""
    save_steps: int = -1
    """save a resumable checkpoint every N optimizer steps (-1: never) [--save_steps, --ckpt.save_steps]"""
    ckpt_path: str | None = None
    """folder of the resumable checkpoints (global_step<N>); default: <run dir>/checkpoints [--ckpt_path,
    --ckpt.path]"""
    max_ckpt_num: int = 3
    """keep this many newest checkpoints; older ones are deleted [--max_ckpt_num, --ckpt.max_num]"""
    max_ckpt_mem: float = 100000000.0
    """GB the resumable checkpoints in --ckpt_path may hold: after a save the oldest are deleted while they hold
    more (the one just saved always stays); as OpenRLHF's [--max_ckpt_mem, --ckpt.max_mem]"""
    load_checkpoint: bool = False
    """resume from the newest intact checkpoint in --ckpt_path, if there is one (none, and the output folders hold
    an earlier run: an error); its run's model, data, batch and learning-rate settings must be this run's
    [--load_checkpoint, --ckpt.load_enable]"""
    allow_resume_changes: str | None = None
    """--load_checkpoint: accept these settings (comma-separated flag names, or all) differing from the checkpoint's
    run as deliberate changes [--allow_resume_changes]"""
    save_hf_ckpt: bool = False
    """also save a Hugging Face snapshot with each checkpoint (<ckpt_path>/global_step<N>_hf) [--save_hf_ckpt,
    --ckpt.save_hf]"""
    hf_max_shard_size: str = "5GB"
    """largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes [--hf_max_shard_size]"""
    save_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """dtype of the saved Hugging Face model (auto: the dtype --pretrain's folder stores, else the compute dtype)
    [--save_dtype]"""
    disable_ds_ckpt: bool = False
    """--save_steps writes no resumable checkpoint (only --save_hf_ckpt snapshots) [--disable_ds_ckpt,
    --ckpt.disable_ds]"""
    stop_grace_s: float = 10.0
    """on SIGINT / SIGTERM the current step may finish within this many seconds (else it is abandoned); then a
    resumable checkpoint is written, the resume command printed, exit 130 / 143 [--stop_grace_s]"""

    # logging
    logging_steps: int = 1
    """log metrics every N optimizer steps [--logging_steps, --logger.logging_steps]"""
    use_wandb: str | None = None
    """log to Weights & Biases: an API key, or 'True' to use the logged-in account [--use_wandb, --logger.wandb.key]"""
    wandb_org: str | None = None
    """wandb entity (team or user) [--wandb_org, --logger.wandb.org]"""
    wandb_group: str | None = None
    """wandb run group [--wandb_group, --logger.wandb.group]"""
    wandb_project: str = "rlhfkit_train_dpo"
    """wandb project [--wandb_project, --logger.wandb.project]"""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb's), also the TensorBoard run's folder under --use_tensorboard
    [--wandb_run_name, --logger.wandb.run_name]"""
    use_tensorboard: str | None = None
    """write TensorBoard event files to <this folder>/<run name>: --wandb_run_name, else the run directory's name
    and the start time (needs tensorboard) [--use_tensorboard, --logger.tensorboard_dir]"""
    disable_progress: bool = False
    """no progress bar [--disable_progress]"""

    # distributed backend
    backend: Literal["fsdp2", "deepspeed"] = "fsdp2"
    """training backend (fsdp2: PyTorch FSDP2, nothing extra to install) [--backend]"""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """sharding over data-parallel ranks, in DeepSpeed ZeRO terms: 0 replicate; 1/2 shard gradients and optimizer
    states; 3 shard the weights too [--zero_stage, --ds.zero_stage]"""
    local_rank: int = -1
    """OpenRLHF: this process's rank on its node; no effect in train_dpo: each process reads its rank from the
    environment (LOCAL_RANK / RANK, set by torchrun and the deepspeed launcher) [--local_rank]"""
    adam_offload: bool = False
    """keep optimizer states and fp32 master weights in host memory (CUDA only) [--adam_offload, --ds.adam_offload]"""
    packing_samples: bool = False
    """pack several samples into one row without padding (attention kept within each sample) [--packing_samples,
    --ds.packing_samples]"""
    ring_attn_size: int = 1
    """context parallelism: each sequence is split over this many ranks, whose attention passes key/value blocks
    round a ring (must divide the world size; 1: off) [--ring_attn_size, --ds.ring_attn_size]"""
    ring_head_stride: int = 1
    """key/value heads that go round the ring together with --ring_attn_size > 1 (must divide the model's key/value
    heads; larger: fewer, bigger ring passes) [--ring_head_stride, --ds.ring_attn_head_stride]"""
    ds_tensor_parallel_size: int = 1
    """tensor-parallel training size: attention heads, MLP and vocabulary split over this many ranks (Llama,
    Qwen2/3, Mistral), FSDP over the rest of the world [--ds_tensor_parallel_size, --ds.tensor_parallel_size]"""
    zpg: int = 1
    """OpenRLHF: ZeRO++ hierarchical partition size; no effect in train_dpo: a DeepSpeed setting; the FSDP2 backend
    has no equivalent [--zpg, --ds.zpg]"""
    overlap_comm: bool = False
    """OpenRLHF: overlap DeepSpeed's gradient reduction with the backward pass; no effect in train_dpo: a DeepSpeed
    setting; the FSDP2 backend has no equivalent [--overlap_comm, --ds.overlap_comm]"""
    grad_accum_dtype: str | None = None
    """OpenRLHF: DeepSpeed's gradient accumulation dtype; no effect in train_dpo: a DeepSpeed setting; the FSDP2
    backend has no equivalent [--grad_accum_dtype, --ds.grad_accum_dtype]"""
    deepcompile: bool = False
    """OpenRLHF: DeepSpeed's DeepCompile; no effect in train_dpo: a DeepSpeed setting; the FSDP2 backend has no
    equivalent [--deepcompile, --ds.deepcompile]"""
    use_universal_ckpt: bool = False
    """OpenRLHF: load DeepSpeed universal checkpoints; no effect in train_dpo: checkpoints
    (torch.distributed.checkpoint) load on any number of ranks without conversion [--use_universal_ckpt,
    --ds.use_universal_ckpt, --use_ds_universal_ckpt]"""
    device: str | None = None
    """cpu or cuda (default: cuda when available) [--device]"""

    # Hugging Face TRL's names for the same settings (init-only; reading one reads ours)
    output_dir: InitVar[str | None] = None
    """TRL's name for `save_path`"""
    per_device_train_batch_size: InitVar[int | None] = None
    """TRL's name for `micro_train_batch_size`"""


@trl_names
@dataclass(repr=False, kw_only=True)
class TrainKTOFields(FlagConfig):
    """The flags of `python -m rlhfkit.cli.train_kto` as fields, with its defaults; the inputs
    (--pretrain, --dataset, --eval_dataset) are the trainer's arguments."""

    COMMAND: ClassVar[str] = "train_kto"
    INPUTS: ClassVar[tuple[str, ...]] = ("pretrain", "dataset", "eval_dataset")

    # general
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """console messages from this level up (debug: also transformers' info messages and third-party progress bars);
    the run directory's train.log gets every level [--log_level]"""
    verbose: bool = False
    """also print third-party messages on the console: transformers' load reports and warnings, other packages'
    FutureWarnings and warnings, their progress bars (without it they go to train.log only; errors always show)
    [--verbose]"""

    # train_kto options
    beta: float = 0.01
    """KTO beta [--beta, --model.beta]"""
    desirable_loss_weight: float = 1.0
    """weight of the loss on desirable answers (lambda_D of the KTO paper) [--desirable_loss_weight,
    --model.desirable_loss_weight]"""
    undesirable_loss_weight: float = 1.0
    """weight of the loss on undesirable answers (lambda_U of the KTO paper) [--undesirable_loss_weight,
    --model.undesirable_loss_weight]"""
    label_key: str = "label"
    """boolean column: true for a desirable answer [--label_key, --data.label_key]"""

    # model
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """compute dtype on GPU (master weights stay fp32); CPU training computes in fp32 [--param_dtype,
    --ds.param_dtype, --fsdp.param_dtype; --bf16 sets "bf16"]"""
    attn_implementation: str = "sdpa"
    """attention kernel of transformers: sdpa, eager, flash_attention_2 (when installed) [--attn_implementation,
    --ds.attn_implementation, --fsdp.attn_implementation; --flash_attn sets "flash_attention_2"]"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about a third more compute
    [--gradient_checkpointing, --model.gradient_checkpointing_enable, --actor.gradient_checkpointing_enable]"""
    mixed_precision: Literal["master_weights", "autocast"] = "master_weights"
    """one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 copies in the
    optimizer) or autocast (fp32 module under torch.autocast) [--mixed_precision]"""
    torch_compile: bool = False
    """torch.compile each transformer block of trained models [--torch_compile]"""
    gradient_checkpointing_use_reentrant: bool = False
    """with --gradient_checkpointing: torch's reentrant checkpoint variant (the default is the non-reentrant one)
    [--gradient_checkpointing_use_reentrant, --model.gradient_checkpointing_reentrant,
    --actor.gradient_checkpointing_reentrant]"""
    disable_fast_tokenizer: bool = False
    """load the slow (Python) tokenizer instead of the fast (Rust) one [--disable_fast_tokenizer,
    --data.disable_fast_tokenizer]"""
    use_liger_kernel: bool = False
    """OpenRLHF: Liger's fused kernels; no effect in train_kto: Liger kernels are not used; the log-prob kernel is
    fused already (rlhfkit.models.fused_logprobs) [--use_liger_kernel, --ds.use_liger_kernel]"""
    aux_loss_coef: float = 0.0
    """weight of a mixture-of-experts model's router load-balancing loss (0: off) [--aux_loss_coef,
    --model.aux_loss_coef, --actor.aux_loss_coef]"""
    experts_implementation: str | None = None
    """mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm (default: the model's
    own) [--experts_implementation, --ds.experts_implementation]"""
    use_ms: bool = False
    """download model ids from ModelScope (needs modelscope) [--use_ms]"""
    ref_pretrain: str | None = None
    """reference model directory or hub id (default: --pretrain) [--ref_pretrain, --ref.model_name_or_path]"""
    ref_offload: bool = False
    """keep the reference model in CPU memory between its forward passes [--ref_offload, --ref.offload]"""

    # LoRA / QLoRA
    lora_rank: int = 0
    """rank of LoRA adapters on the trained model (0: train all weights); the saved model is the adapter (peft
    format) [--lora_rank, --ds.lora.rank]"""
    lora_alpha: int = 16
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank [--lora_alpha, --ds.lora.alpha]"""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """module names that get LoRA adapters (peft's target_modules; all-linear: every linear layer but the output
    head) [--target_modules, --ds.lora.target_modules]"""
    lora_dropout: float = 0.0
    """dropout probability on the LoRA adapters' input [--lora_dropout, --ds.lora.dropout]"""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base weights in 4-bit NF4 (needs bitsandbytes and CUDA; use with --lora_rank)
    [--load_in_4bit, --ds.load_in_4bit]"""

    # data
    dataset_probs: str | None = None
    """comma-separated sampling probabilities, one per --dataset entry (default: concatenate) [--dataset_probs,
    --data.dataset_probs]"""
    dataset_split: str = "train"
    """split of --dataset to read (for datasets with splits) [--dataset_split, --data.dataset_split, --train_split]"""
    input_key: str = "input"
    """column with the prompt (or the whole text / conversation) [--input_key, --data.input_key]"""
    output_key: str = "output"
    """column with the response (see the command's description) [--output_key, --data.output_key]"""
    input_template: str | None = None
    """format of the prompt with one {} for the --input_key text (default, or '': the text as it is)
    [--input_template, --data.input_template]"""
    apply_chat_template: bool = False
    """format prompts and conversations with the tokenizer's chat template (off: one line says when the tokenizer
    has one) [--apply_chat_template, --data.apply_chat_template]"""
    tokenizer_chat_template: str | None = None
    """a Jinja chat template that replaces the tokenizer's own [--tokenizer_chat_template,
    --data.tokenizer_chat_template]"""
    max_len: int = 2048
    """longest sample in tokens; longer samples are dropped (counted and reported) [--max_len, --data.max_len]"""
    max_samples: int = 1000000
    """read at most this many rows of the data (after mixing) [--max_samples, --data.max_samples]"""
    max_row_bytes: int = 1000000
    """largest input row in bytes; a larger row is an error naming file and row [--max_row_bytes,
    --data.max_row_bytes]"""
    dataloader_num_workers: int = 0
    """OpenRLHF: DataLoader worker processes; no effect in train_kto: data is tokenized once up front and batched in
    the training process (no loader workers) [--dataloader_num_workers, --data.dataloader_num_workers]"""

    # training
    train_batch_size: int = 128
    """global samples per optimizer step (all ranks together; gradient accumulation makes up the rest)
    [--train_batch_size, --train.batch_size]"""
    micro_train_batch_size: int = 8
    """samples per forward/backward pass on each rank [--micro_train_batch_size, --train.micro_batch_size]"""
    max_epochs: int = 1
    """passes over the data [--max_epochs, --train.max_epochs]"""
    seed: int = 42
    """seed of python, numpy, torch and data shuffling [--seed, --train.seed]"""
    full_determinism: bool = False
    """deterministic torch algorithms (transformers.enable_full_determinism): reproducible, slower
    [--full_determinism, --train.full_determinism_enable]"""
    max_steps: int | None = None
    """optimizer steps to take, cycling the data as often as needed (overrides --max_epochs) [--max_steps]"""

    # optimizer
    learning_rate: float = 1e-05
    """peak learning rate [--learning_rate, --adam.lr]"""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW beta1 beta2 [--adam_betas, --adam.betas]"""
    adam_eps: float = 1e-08
    """AdamW epsilon [--adam_eps, --adam.eps]"""
    l2: float = 0.0
    """AdamW weight decay [--l2, --adam.weight_decay]"""
    optim: Literal["adam", "adamw_8bit", "muon"] = "adam"
    """optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value (blockwise float8
    codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights of hidden layers, AdamW for
    the rest [--optim]"""
    master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = "fp32"
    """trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic: bf16 weights and
    gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same with a bf16 compensation of
    the rounding error (2 more bytes a parameter). The bf16 modes need --param_dtype bf16 and --optim adam or
    adamw_8bit [--master_weights]"""
    muon_lr: float = 0.02
    """Muon learning rate (--optim muon) [--muon_lr, --muon.lr]"""
    muon_momentum: float = 0.95
    """Muon momentum [--muon_momentum, --muon.momentum]"""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalise the update [--muon_ns_steps, --muon.ns_steps]"""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum (default) [--muon_nesterov, --muon.nesterov; --muon_no_nesterov sets False]"""
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr"] = "cosine_with_min_lr"
    """learning-rate schedule (transformers.get_scheduler), after a linear warm-up from 0 [--lr_scheduler]"""
    lr_warmup_ratio: float = 0.03
    """fraction of the optimizer steps spent warming up linearly from 0 [--lr_warmup_ratio]"""
    min_lr_ratio: float = 0.1
    """cosine_with_min_lr, cosine_warmup_with_min_lr: the learning rate ends at this fraction of the peak
    [--min_lr_ratio]"""
    max_norm: float = 1.0
    """clip the gradient's global L2 norm to this (0 disables) [--max_norm]"""
    max_nonfinite_steps: int = 3
    """optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row (or a non-finite
    weight) stop the run with exit code 1, nothing saved [--max_nonfinite_steps]"""
    max_weight_growth: float = 100.0
    """a trainable weight whose magnitude exceeds this many times the largest at the start of training (at least 1)
    stops the run with exit code 1, nothing saved (0: off) [--max_weight_growth]"""
    max_zero_grad_steps: int = 3
    """more than this many optimizer steps in a row whose gradient is exactly 0 while the loss is not (a saturated
    model) stop the run with exit code 1, nothing saved (-1: off) [--max_zero_grad_steps]"""

    # evaluation
    eval_split: str = "train"
    """split of --eval_dataset to read [--eval_split, --eval.split]"""
    eval_steps: int = -1
    """evaluate every N steps (-1: once per epoch) [--eval_steps, --eval.steps]"""

    # checkpoints and output
    save_path: str = "./ckpt"
    """where the final model is saved in Hugging Face format [--save_path, --ckpt.output_dir]"""
    run_dir: str | None = None
    """metrics.jsonl, run_config.json and plots (default: --save_path) [--run_dir]"""
    overwrite_output_dir: bool = False
    """start over in a --save_path / --run_dir holding an earlier run: its metrics, run_config.json and the
    checkpoints inside it are removed (without it such a folder is refused) [--overwrite_output_dir,
    --ckpt.overwrite_output_dir]"""
    save_steps: int = -1
    """save a resumable checkpoint every N optimizer steps (-1: never) [--save_steps, --ckpt.save_steps]"""
    ckpt_path: str | None = None
    """folder of the resumable checkpoints (global_step<N>); default: <run dir>/checkpoints [--ckpt_path,
    --ckpt.path]"""
    max_ckpt_num: int = 3
    """keep this many newest checkpoints; older ones are deleted [--max_ckpt_num, --ckpt.max_num]"""
    max_ckpt_mem: float = 100000000.0
    """GB the resumable checkpoints in --ckpt_path may hold: after a save the oldest are deleted while they hold
    more (the one just saved always stays); as OpenRLHF's [--max_ckpt_mem, --ckpt.max_mem]"""
    load_checkpoint: bool = False
    """resume from the newest intact checkpoint in --ckpt_path, if there is one (none, and the output folders hold
    an earlier run: an error); its run's model, data, batch and learning-rate settings must be this run's
    [--load_checkpoint, --ckpt.load_enable]"""
    allow_resume_changes: str | None = None
    """--load_checkpoint: accept these settings (comma-separated flag names, or all) differing from the checkpoint's
    run as deliberate changes [--allow_resume_changes]"""
    save_hf_ckpt: bool = False
    """also save a Hugging Face snapshot with each checkpoint (<ckpt_path>/global_step<N>_hf) [--save_hf_ckpt,
    --ckpt.save_hf]"""
    hf_max_shard_size: str = "5GB"
    """largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes [--hf_max_shard_size]"""
    save_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """dtype of the saved Hugging Face model (auto: the dtype --pretrain's folder stores, else the compute dtype)
    [--save_dtype]"""
    disable_ds_ckpt: bool = False
    """--save_steps writes no resumable checkpoint (only --save_hf_ckpt snapshots) [--disable_ds_ckpt,
    --ckpt.disable_ds]"""
    stop_grace_s: float = 10.0
    """on SIGINT / SIGTERM the current step may finish within this many seconds (else it is abandoned); then a
    resumable checkpoint is written, the resume command printed, exit 130 / 143 [--stop_grace_s]"""

    # logging
    logging_steps: int = 1
    """log metrics every N optimizer steps [--logging_steps, --logger.logging_steps]"""
    use_wandb: str | None = None
    """log to Weights & Biases: an API key, or 'True' to use the logged-in account [--use_wandb, --logger.wandb.key]"""
    wandb_org: str | None = None
    """wandb entity (team or user) [--wandb_org, --logger.wandb.org]"""
    wandb_group: str | None = None
    """wandb run group [--wandb_group, --logger.wandb.group]"""
    wandb_project: str = "rlhfkit_train_kto"
    """wandb project [--wandb_project, --logger.wandb.project]"""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb's), also the TensorBoard run's folder under --use_tensorboard
    [--wandb_run_name, --logger.wandb.run_name]"""
    use_tensorboard: str | None = None
    """write TensorBoard event files to <this folder>/<run name>: --wandb_run_name, else the run directory's name
    and the start time (needs tensorboard) [--use_tensorboard, --logger.tensorboard_dir]"""
    disable_progress: bool = False
    """no progress bar [--disable_progress]"""

    # distributed backend
    backend: Literal["fsdp2", "deepspeed"] = "fsdp2"
    """training backend (fsdp2: PyTorch FSDP2, nothing extra to install) [--backend]"""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """sharding over data-parallel ranks, in DeepSpeed ZeRO terms: 0 replicate; 1/2 shard gradients and optimizer
    states; 3 shard the weights too [--zero_stage, --ds.zero_stage]"""
    local_rank: int = -1
    """OpenRLHF: this process's rank on its node; no effect in train_kto: each process reads its rank from the
    environment (LOCAL_RANK / RANK, set by torchrun and the deepspeed launcher) [--local_rank]"""
    adam_offload: bool = False
    """keep optimizer states and fp32 master weights in host memory (CUDA only) [--adam_offload, --ds.adam_offload]"""
    packing_samples: bool = False
    """pack several samples into one row without padding (attention kept within each sample) [--packing_samples,
    --ds.packing_samples]"""
    ring_attn_size: int = 1
    """context parallelism: each sequence is split over this many ranks, whose attention passes key/value blocks
    round a ring (must divide the world size; 1: off) [--ring_attn_size, --ds.ring_attn_size]"""
    ring_head_stride: int = 1
    """key/value heads that go round the ring together with --ring_attn_size > 1 (must divide the model's key/value
    heads; larger: fewer, bigger ring passes) [--ring_head_stride, --ds.ring_attn_head_stride]"""
    ds_tensor_parallel_size: int = 1
    """tensor-parallel training size: attention heads, MLP and vocabulary split over this many ranks (Llama,
    Qwen2/3, Mistral), FSDP over the rest of the world [--ds_tensor_parallel_size, --ds.tensor_parallel_size]"""
    zpg: int = 1
    """OpenRLHF: ZeRO++ hierarchical partition size; no effect in train_kto: a DeepSpeed setting; the FSDP2 backend
    has no equivalent [--zpg, --ds.zpg]"""
    overlap_comm: bool = False
    """OpenRLHF: overlap DeepSpeed's gradient reduction with the backward pass; no effect in train_kto: a DeepSpeed
    setting; the FSDP2 backend has no equivalent [--overlap_comm, --ds.overlap_comm]"""
    grad_accum_dtype: str | None = None
    """OpenRLHF: DeepSpeed's gradient accumulation dtype; no effect in train_kto: a DeepSpeed setting; the FSDP2
    backend has no equivalent [--grad_accum_dtype, --ds.grad_accum_dtype]"""
    deepcompile: bool = False
    """OpenRLHF: DeepSpeed's DeepCompile; no effect in train_kto: a DeepSpeed setting; the FSDP2 backend has no
    equivalent [--deepcompile, --ds.deepcompile]"""
    use_universal_ckpt: bool = False
    """OpenRLHF: load DeepSpeed universal checkpoints; no effect in train_kto: checkpoints
    (torch.distributed.checkpoint) load on any number of ranks without conversion [--use_universal_ckpt,
    --ds.use_universal_ckpt, --use_ds_universal_ckpt]"""
    device: str | None = None
    """cpu or cuda (default: cuda when available) [--device]"""

    # Hugging Face TRL's names for the same settings (init-only; reading one reads ours)
    output_dir: InitVar[str | None] = None
    """TRL's name for `save_path`"""
    per_device_train_batch_size: InitVar[int | None] = None
    """TRL's name for `micro_train_batch_size`"""


@trl_names
@dataclass(repr=False, kw_only=True)
class TrainPPOFields(FlagConfig):
    """The flags of `python -m rlhfkit.cli.train_ppo` as fields, with its defaults; the inputs
    (--pretrain, --prompt_data, --eval_dataset, --remote_rm_url) are the trainer's arguments."""

    COMMAND: ClassVar[str] = "train_ppo"
    INPUTS: ClassVar[tuple[str, ...]] = ("pretrain", "prompt_data", "eval_dataset", "remote_rm_url")

    # general
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """console messages from this level up (debug: also transformers' info messages and third-party progress bars);
    the run directory's train.log gets every level [--log_level]"""
    verbose: bool = False
    """also print third-party messages on the console: transformers' load reports and warnings, other packages'
    FutureWarnings and warnings, their progress bars (without it they go to train.log only; errors always show)
    [--verbose]"""

    # model
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """compute dtype on GPU (master weights stay fp32); CPU training computes in fp32 [--param_dtype,
    --ds.param_dtype, --fsdp.param_dtype; --bf16 sets "bf16"]"""
    attn_implementation: str = "sdpa"
    """attention kernel of transformers: sdpa, eager, flash_attention_2 (when installed) [--attn_implementation,
    --ds.attn_implementation, --fsdp.attn_implementation; --flash_attn sets "flash_attention_2"]"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass: less memory, about a third more compute
    [--gradient_checkpointing, --model.gradient_checkpointing_enable, --actor.gradient_checkpointing_enable]"""
    mixed_precision: Literal["master_weights", "autocast"] = "master_weights"
    """one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 copies in the
    optimizer) or autocast (fp32 module under torch.autocast) [--mixed_precision]"""
    torch_compile: bool = False
    """torch.compile each transformer block of trained models [--torch_compile]"""
    gradient_checkpointing_use_reentrant: bool = False
    """with --gradient_checkpointing: torch's reentrant checkpoint variant (the default is the non-reentrant one)
    [--gradient_checkpointing_use_reentrant, --model.gradient_checkpointing_reentrant,
    --actor.gradient_checkpointing_reentrant]"""
    disable_fast_tokenizer: bool = False
    """load the slow (Python) tokenizer instead of the fast (Rust) one [--disable_fast_tokenizer,
    --data.disable_fast_tokenizer]"""
    use_liger_kernel: bool = False
    """OpenRLHF: Liger's fused kernels; no effect in train_ppo: Liger kernels are not used; the log-prob kernel is
    fused already (rlhfkit.models.fused_logprobs) [--use_liger_kernel, --ds.use_liger_kernel]"""
    aux_loss_coef: float = 0.0
    """weight of a mixture-of-experts model's router load-balancing loss (0: off) [--aux_loss_coef,
    --model.aux_loss_coef, --actor.aux_loss_coef]"""
    experts_implementation: str | None = None
    """mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm (default: the model's
    own) [--experts_implementation, --ds.experts_implementation]"""
    use_ms: bool = False
    """download model ids from ModelScope (needs modelscope) [--use_ms]"""
    freeze_visual_encoder: bool = False
    """vision-language models: the vision tower does not train (nor go to the rollout engines); the language model
    and its head do [--freeze_visual_encoder, --actor.freeze_visual_encoder]"""

    # LoRA / QLoRA
    lora_rank: int = 0
    """rank of LoRA adapters on the trained model (0: train all weights); the saved model is the adapter (peft
    format) [--lora_rank, --ds.lora.rank]"""
    lora_alpha: int = 16
    """LoRA scaling numerator: the adapter's update is scaled by alpha / rank [--lora_alpha, --ds.lora.alpha]"""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """module names that get LoRA adapters (peft's target_modules; all-linear: every linear layer but the output
    head) [--target_modules, --ds.lora.target_modules]"""
    lora_dropout: float = 0.0
    """dropout probability on the LoRA adapters' input [--lora_dropout, --ds.lora.dropout]"""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base weights in 4-bit NF4 (needs bitsandbytes and CUDA; use with --lora_rank)
    [--load_in_4bit, --ds.load_in_4bit]"""

    # data
    prompt_data_probs: str | None = None
    """comma-separated sampling probabilities, one per --prompt_data entry [--prompt_data_probs,
    --data.prompt_probs]"""
    prompt_split: str = "train"
    """split of --prompt_data to read [--prompt_split, --data.prompt_split, --train_split]"""
    input_key: str = "input"
    """column with the prompt text or conversation [--input_key, --data.input_key]"""
    label_key: str | None = None
    """column handed to reward_func / the agent as the label (e.g. the reference answer) [--label_key,
    --data.label_key]"""
    input_template: str | None = None
    """format of the prompt with one {} for the --input_key text (default, or '': the text as it is)
    [--input_template, --data.input_template]"""
    apply_chat_template: bool = False
    """format prompts and conversations with the tokenizer's chat template (off: one line says when the tokenizer
    has one) [--apply_chat_template, --data.apply_chat_template]"""
    tokenizer_chat_template: str | None = None
    """a Jinja chat template that replaces the tokenizer's own [--tokenizer_chat_template,
    --data.tokenizer_chat_template]"""
    max_samples: int = 100000000
    """read at most this many prompts [--max_samples, --data.max_samples]"""
    max_row_bytes: int = 1000000
    """largest input row in bytes; a larger row is an error naming file and row [--max_row_bytes,
    --data.max_row_bytes]"""
    max_len: int | None = None
    """prompt + response token budget (default: --prompt_max_len + --generate_max_len) [--max_len, --data.max_len]"""
    prompt_max_len: int = 1024
    """longest prompt in tokens; longer prompts are dropped (counted) [--prompt_max_len]"""
    dataloader_num_workers: int = 0
    """OpenRLHF: DataLoader worker processes; no effect in train_ppo: data is tokenized once up front and batched in
    the training process (no loader workers) [--dataloader_num_workers, --data.dataloader_num_workers]"""
    image_key: str = "images"
    """column with a row's pictures: file paths, http(s) URLs, base64 data URIs or image bytes (one, or a list)
    [--image_key, --data.image_key]"""
    max_images_per_prompt: int = 0
    """> 0 turns on vision-language mode: pictures of --image_key go with each sample, at most this many (a row with
    more is an error) [--max_images_per_prompt, --data.max_images_per_prompt]"""
    image_failure: Literal["stop", "drop"] = "stop"
    """a missing, unreadable or too large picture: stop with an error naming file and row, or drop its row (counted)
    [--image_failure]"""
    max_image_bytes: int = 33554432
    """largest picture file in bytes [--max_image_bytes]"""
    max_image_pixels: int = 16777216
    """largest picture in pixels (width x height) [--max_image_pixels]"""

    # training
    train_batch_size: int = 128
    """samples per optimizer step (all ranks together); a rollout of --rollout_batch_size x --n_samples_per_prompt
    samples makes that many / this many steps [--train_batch_size, --train.batch_size]"""
    micro_train_batch_size: int = 1
    """samples per forward/backward pass on each rank [--micro_train_batch_size, --train.micro_batch_size]"""
    max_epochs: int = 1
    """PPO epochs over each rollout [--max_epochs, --train.max_epochs]"""
    recompute_old_logprobs: bool = False
    """run the old policy's log-prob pass even when a rollout makes one optimizer step (by default the training
    pass's detached log-probs are the old ones then, ratio 1, as in TRL's GRPO) [--recompute_old_logprobs]"""
    num_episodes: int = 1
    """passes over the prompts [--num_episodes, --train.num_episodes]"""
    max_steps: int | None = None
    """RL steps to take (a rollout and its policy update each), cycling the prompts as often as needed (overrides
    --num_episodes) [--max_steps]"""
    seed: int = 42
    """seed of python, numpy, torch, data and sampling [--seed, --train.seed]"""
    full_determinism: bool = False
    """deterministic torch algorithms (transformers.enable_full_determinism): reproducible, slower
    [--full_determinism, --train.full_determinism_enable]"""
    use_dynamic_batch: bool = False
    """micro-batches by token budget (--train_max_tokens_per_gpu) instead of sample count [--use_dynamic_batch,
    --train.dynamic_batch_enable]"""
    train_max_tokens_per_gpu: int = 16192
    """--use_dynamic_batch: tokens per training micro-batch on each rank [--train_max_tokens_per_gpu,
    --train.max_tokens_per_gpu]"""
    freezing_actor_steps: int = -1
    """train only the critic for the first N steps (critic warm-up; -1: off) [--freezing_actor_steps,
    --critic.freezing_steps]"""
    save_value_network: bool = False
    """also save the critic, to <save_path>_critic [--save_value_network, --critic.save_value_network]"""
    enable_ema: bool = False
    """keep an exponential moving average of the policy's weights; it is what gets saved [--enable_ema,
    --train.enable_ema]"""
    ema_beta: float | None = None
    """EMA decay (default 0.992): ema = beta * ema + (1 - beta) * weights after every optimizer step [--ema_beta,
    --train.ema_beta]"""
    actor_init_on_gpu: bool = False
    """OpenRLHF: build the actor directly on the GPU; no effect in train_ppo: models are loaded on the host and
    moved (or sharded) onto the device by the backend [--actor_init_on_gpu]"""
    perf: bool = False
    """OpenRLHF: log step timings; no effect in train_ppo: step timings are always logged (time/* in metrics.jsonl)
    [--perf]"""
    max_nonfinite_steps: int = 3
    """optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row (or a non-finite
    weight) stop the run with exit code 1, nothing saved [--max_nonfinite_steps]"""
    max_weight_growth: float = 100.0
    """a trainable weight whose magnitude exceeds this many times the largest at the start of training (at least 1)
    stops the run with exit code 1, nothing saved (0: off) [--max_weight_growth]"""
    max_zero_grad_steps: int = 3
    """more than this many optimizer steps in a row whose gradient is exactly 0 while the loss is not (a saturated
    model) stop the run with exit code 1, nothing saved (-1: off) [--max_zero_grad_steps]"""
    max_failed_steps: int = 3
    """steps in a row without a trajectory to train on (all samples dropped or filtered out) before the run stops;
    fewer are skipped and counted in skipped_steps [--max_failed_steps]"""

    # optimizer
    actor_learning_rate: float = 1e-06
    """the policy's peak learning rate [--actor_learning_rate, --actor.adam.lr]"""
    critic_learning_rate: float = 9e-06
    """the critic's peak learning rate [--critic_learning_rate, --critic.adam.lr]"""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW beta1 beta2 (the flat name sets the critic's too) [--adam_betas, --actor.adam.betas]"""
    adam_eps: float = 1e-08
    """AdamW epsilon (the flat name sets the critic's too) [--adam_eps, --actor.adam.eps]"""
    l2: float = 0.0
    """AdamW weight decay (the flat name sets the critic's too) [--l2, --actor.adam.weight_decay]"""
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr"] = "cosine_with_min_lr"
    """learning-rate schedule (transformers.get_scheduler), after a linear warm-up from 0 [--lr_scheduler,
    --actor.lr_scheduler]"""
    lr_warmup_ratio: float = 0.03
    """fraction of the optimizer steps spent warming up linearly from 0 [--lr_warmup_ratio, --actor.lr_warmup_ratio]"""
    min_lr_ratio: float = 0.1
    """cosine_with_min_lr, cosine_warmup_with_min_lr: the learning rate ends at this fraction of the peak
    [--min_lr_ratio, --actor.min_lr_ratio]"""
    max_norm: float = 1.0
    """clip the gradient's global L2 norm to this (0 disables) [--max_norm, --actor.max_norm]"""
    optim: Literal["adam", "adamw_8bit", "muon"] = "adam"
    """optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value (blockwise float8
    codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights of hidden layers, AdamW for
    the rest [--optim, --actor.optim]"""
    master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = "fp32"
    """trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic: bf16 weights and
    gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same with a bf16 compensation of
    the rounding error (2 more bytes a parameter). The bf16 modes need --param_dtype bf16 and --optim adam or
    adamw_8bit [--master_weights, --actor.master_weights]"""
    muon_lr: float = 0.02
    """Muon learning rate (--optim muon) [--muon_lr, --actor.muon.lr]"""
    muon_momentum: float = 0.95
    """Muon momentum [--muon_momentum, --actor.muon.momentum]"""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations that orthogonalise the update [--muon_ns_steps, --actor.muon.ns_steps]"""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum (default) [--muon_nesterov, --actor.muon.nesterov; --muon_no_nesterov sets False]"""

    # RL: reward, critic and reference models
    reward_pretrain: str | None = None
    """reward model directory or hub id (a sequence classifier with one output); several, comma-separated, are
    summed [--reward_pretrain, --reward.model_name_or_path]"""
    critic_pretrain: str | None = None
    """initial critic (value model; directory or hub id) for --advantage_estimator gae (default: --reward_pretrain,
    else --pretrain) [--critic_pretrain, --critic.model_name_or_path]"""
    ref_pretrain: str | None = None
    """reference model of the KL term, directory or hub id (default: --pretrain) [--ref_pretrain,
    --ref.model_name_or_path]"""
    ref_offload: bool = False
    """keep the reference model in host memory between its forward passes [--ref_offload, --ref.offload]"""
    value_head_prefix: str = "score"
    """name of the reward / critic model's value head module [--value_head_prefix, --ds.value_head_prefix,
    --value_prefix_head]"""
    ref_reward_offload: bool = False
    """both --ref_offload and --reward_offload [--ref_reward_offload]"""
    reward_offload: bool = False
    """keep the reward model(s) in host memory between their forward passes [--reward_offload, --reward.offload]"""

    # RL: reward and agents
    agent_func_path: str | None = None
    """a .py file defining AgentExecutor (multi-turn) or AgentInstance (step() gives the reward) [--agent_func_path,
    --train.agent_func_path]"""
    reward_failure: Literal["stop", "drop"] = "stop"
    """what a reward_func / agent exception does: stop the run, or drop the sample (counted) [--reward_failure]"""
    reward_timeout: float = 300.0
    """seconds for one reward_func / agent step call (a reward worker past it is killed); a reward server is retried
    within twice this [--reward_timeout]"""
    reward_workers: int | None = None
    """worker processes that run a --remote_rm_url reward_func .py file (default: the CPU count, at most 4): a call
    past --reward_timeout is killed, and CPU-bound reward code runs beside the rollout engine. 0: threads of the
    trainer, where a call that never returns cannot be stopped [--reward_workers]"""
    normalize_reward: bool = False
    """normalise reward-model scores with the mean / std stored in its config [--normalize_reward,
    --reward.normalize_enable]"""
    reward_clip_range: list[float] = field(default_factory=lambda: [-10.0, 10.0])
    """LOW HIGH: clamp the scalar reward to this range before KL shaping [--reward_clip_range, --reward.clip_range]"""
    overlong_buffer_len: int | None = None
    """DAPO soft overlong penalty: responses within this many tokens of --generate_max_len lose reward linearly
    (default: off) [--overlong_buffer_len, --reward.overlong_buffer_len]"""
    overlong_penalty_factor: float = 1.0
    """the largest overlong penalty (at --generate_max_len) [--overlong_penalty_factor,
    --reward.overlong_penalty_factor]"""
    stop_properly_penalty_coef: float | None = None
    """ProRL: a truncated response's reward is multiplied by c >= 0, or replaced by c < 0 (default: off)
    [--stop_properly_penalty_coef, --reward.stop_properly_penalty_coef]"""

    # RL: rollout (generation)
    rollout_engine: Literal["auto", "builtin", "hf", "vllm"] = "auto"
    """generation engine: builtin (continuous batching, no extra package), hf (transformers generate, slow
    reference) or vllm (when installed); auto: builtin when it supports the model, else vllm when installed, else
    hf (one line says which and why) [--rollout_engine]"""
    rollout_max_num_seqs: int | None = None
    """sequences the engine decodes at once (default: all samples of a step on this rank, at most 512)
    [--rollout_max_num_seqs]"""
    engine_weights: Literal["auto", "shared", "copy"] = "auto"
    """train_ppo in one process: the builtin engine serves the policy's own weights (shared: one copy on the device,
    nothing copied per step) or holds a copy of its own (copy); auto: shared where possible (one rank, weights in
    the engine's dtype; a LoRA policy's adapters are applied unmerged), one line says which; train_ppo_ray's
    engines always hold their own [--engine_weights]"""
    rollout_compile: bool = False
    """torch.compile the builtin engine's decode step (GPU): fewer, fused kernels per step, for long runs; its
    compilation adds 20-30 s to the first step (a few seconds with the cache a previous run left,
    docs/performance.md); off: eager kernels replayed as CUDA graphs [--rollout_compile]"""
    rollout_batch_size: int = 1024
    """prompts per RL step [--rollout_batch_size, --rollout.batch_size]"""
    n_samples_per_prompt: int = 1
    """samples generated per prompt (the group of GRPO / RLOO) [--n_samples_per_prompt,
    --rollout.n_samples_per_prompt]"""
    micro_rollout_batch_size: int = 8
    """samples per forward pass when computing log-probs, values and rewards of a rollout
    [--micro_rollout_batch_size, --rollout.micro_batch_size]"""
    generate_max_len: int | None = None
    """new tokens of one generation (default: 1024; with --max_len given, what --max_len leaves after the prompt, as
    OpenRLHF's --rollout.max_new_tokens) [--generate_max_len, --max_new_tokens, --rollout.max_new_tokens]"""
    temperature: float = 1.0
    """sampling temperature (the training log-probs use it too) [--temperature, --rollout.temperature]"""
    top_p: float = 1.0
    """nucleus sampling: keep this probability mass [--top_p, --rollout.top_p]"""
    top_k: int = -1
    """sample from the k likeliest tokens (-1: all) [--top_k, --rollout.top_k]"""
    rollout_max_tokens_per_gpu: int | None = None
    """--use_dynamic_batch: tokens per forward pass of experience making (default: --train_max_tokens_per_gpu)
    [--rollout_max_tokens_per_gpu, --rollout.max_tokens_per_gpu]"""
    vllm_generate_batch_size: int | None = None
    """OpenRLHF: prompts generated per round (over-sampling); no effect in train_ppo: each step generates
    --rollout_batch_size prompts (dynamic filtering draws more as needed) [--vllm_generate_batch_size,
    --rollout.vllm_generate_batch_size]"""

    # RL: algorithm (advantages, KL, policy loss)
    advantage_estimator: Literal["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "grpo", "dr_grpo"] = "gae"
    """gae (PPO with a critic), reinforce (REINFORCE++), reinforce_baseline (REINFORCE++-baseline), rloo, group_norm
    or grpo (GRPO), dr_grpo (Dr. GRPO); the group ones need --n_samples_per_prompt > 1 [--advantage_estimator,
    --algo.advantage.estimator]"""
    gamma: float = 1.0
    """discount factor of the returns [--gamma, --algo.advantage.gamma]"""
    lambd: float = 1.0
    """GAE lambda (--advantage_estimator gae) [--lambd, --algo.advantage.lambd]"""
    no_advantage_std_norm: bool = False
    """normalise advantages by subtracting the mean only, without dividing by the std [--no_advantage_std_norm,
    --algo.advantage.no_std_norm]"""
    init_kl_coef: float = 0.01
    """weight of the KL penalty against the reference model (0: no reference model at all) [--init_kl_coef,
    --algo.kl.init_coef]"""
    kl_target: float | None = None
    """adaptive KL controller: move the KL coefficient towards this KL per sample (default: fixed coefficient)
    [--kl_target, --algo.kl.target]"""
    kl_horizon: int = 10000
    """adaptive KL controller: samples over which the coefficient adapts [--kl_horizon, --algo.kl.horizon]"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator (Schulman's k1 = log ratio, k2 = squared log ratio / 2, k3 = ratio - 1 - log ratio)
    [--kl_estimator, --algo.kl.estimator]"""
    use_kl_loss: bool = False
    """KL as a loss term of the policy (GRPO) instead of a penalty in the reward [--use_kl_loss, --algo.kl.use_loss]"""
    policy_loss_type: Literal["ppo", "gspo"] = "ppo"
    """ppo: token-level clipped ratio; gspo: sequence-level ratio (GSPO) [--policy_loss_type,
    --actor.policy_loss_type]"""
    eps_clip: float = 0.2
    """PPO clip range: the ratio is clipped to [1 - eps, 1 + eps] [--eps_clip, --actor.eps_clip]"""
    eps_clip_low_high: list[float] | None = None
    """asymmetric clip range LOW HIGH, [1 - low, 1 + high] (DAPO clip-higher; default: --eps_clip twice)
    [--eps_clip_low_high, --actor.eps_clip_low_high]"""
    clip_eps_low: float | None = None
    """alias: lower clip (sets --eps_clip_low_high[0]) [--clip_eps_low]"""
    clip_eps_high: float | None = None
    """alias: upper clip (sets --eps_clip_low_high[1]) [--clip_eps_high]"""
    dual_clip: float | None = None
    """dual-clip PPO bound c > 1 for negative advantages (default: off) [--dual_clip, --actor.dual_clip]"""
    value_clip: float = 0.5
    """the critic's value clip: new values stay within this of the old ones in the loss [--value_clip,
    --critic.value_clip]"""
    entropy_loss_coef: float | None = None
    """weight of an entropy bonus in the policy loss (default: none) [--entropy_loss_coef, --actor.entropy_coef]"""
    dynamic_filtering: bool = False
    """DAPO dynamic sampling: drop prompt groups whose mean score lies outside --dynamic_filtering_reward_range and
    generate more [--dynamic_filtering, --algo.dynamic_filtering_enable]"""
    dynamic_filtering_reward_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """open interval LOW HIGH of group-mean scores kept by --dynamic_filtering [--dynamic_filtering_reward_range,
    --algo.dynamic_filtering_range]"""
    max_filter_rounds: int = 8
    """--dynamic_filtering: generation rounds per step at most (the first included); a step whose rounds keep no
    group is skipped and counted (--max_failed_steps) [--max_filter_rounds]"""
    enable_vllm_is_correction: bool = False
    """importance-sampling correction for the engine's log-probs differing from the trainer's
    [--enable_vllm_is_correction, --algo.advantage.is_correction_enable]"""
    vllm_is_truncated_threshold: list[float] = field(default_factory=lambda: [0.5, 5.0])
    """LOW HIGH bounds of the importance ratio of --enable_vllm_is_correction [--vllm_is_truncated_threshold,
    --algo.advantage.is_correction_threshold]"""
    vllm_is_correction_type: Literal["tis", "icepop", "seq-mask-tis"] = "tis"
    """tis: truncate the ratio at HIGH; icepop: mask tokens outside [LOW, HIGH]; seq-mask-tis: mask whole sequences
    [--vllm_is_correction_type, --algo.advantage.is_correction_type]"""
    use_icepop: bool = False
    """alias of --enable_vllm_is_correction --vllm_is_correction_type icepop [--use_icepop]"""

    # RL: critic optimizer
    critic_adam_betas: list[float] | None = None
    """the critic's --adam_betas (default: the actor's) [--critic_adam_betas, --critic.adam.betas]"""
    critic_adam_eps: float | None = None
    """the critic's --adam_eps (default: the actor's) [--critic_adam_eps, --critic.adam.eps]"""
    critic_l2: float | None = None
    """the critic's --l2 (default: the actor's) [--critic_l2, --critic.adam.weight_decay]"""
    critic_lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr"] | None = None
    """the critic's --lr_scheduler (default: the actor's) [--critic_lr_scheduler, --critic.lr_scheduler]"""
    critic_lr_warmup_ratio: float | None = None
    """the critic's --lr_warmup_ratio (default: the actor's) [--critic_lr_warmup_ratio, --critic.lr_warmup_ratio]"""
    critic_min_lr_ratio: float | None = None
    """the critic's --min_lr_ratio (default: the actor's) [--critic_min_lr_ratio, --critic.min_lr_ratio]"""
    critic_max_norm: float | None = None
    """the critic's --max_norm (default: the actor's) [--critic_max_norm, --critic.max_norm]"""
    critic_optim: Literal["adam", "adamw_8bit", "muon"] = "adam"
    """the critic's optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value
    (blockwise float8 codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights of hidden
    layers, AdamW for the rest [--critic_optim, --critic.optim]"""
    critic_master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = "fp32"
    """the critic's trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic:
    bf16 weights and gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same with a
    bf16 compensation of the rounding error (2 more bytes a parameter). The bf16 modes need --param_dtype bf16
    and --optim adam or adamw_8bit [--critic_master_weights, --critic.master_weights]"""
    critic_muon_lr: float = 0.02
    """the critic's Muon learning rate (--critic_optim muon) [--critic_muon_lr, --critic.muon.lr]"""
    critic_muon_momentum: float = 0.95
    """the critic's Muon momentum [--critic_muon_momentum, --critic.muon.momentum]"""
    critic_muon_ns_steps: int = 5
    """the critic's Muon: Newton-Schulz iterations that orthogonalise the update [--critic_muon_ns_steps,
    --critic.muon.ns_steps]"""
    critic_muon_nesterov: bool = True
    """the critic's Muon: Nesterov momentum (default) [--critic_muon_nesterov, --critic.muon.nesterov;
    --critic_muon_no_nesterov sets False]"""

    # RL: async training
    async_train: bool = False
    """generate the next rollouts while the policy trains (train_ppo_ray) [--async_train, --train.async_enable]"""
    async_queue_size: int = 1
    """rollouts generated ahead of the policy at most (bounds the off-policyness) [--async_queue_size,
    --train.async_queue_size]"""
    partial_rollout: bool = False
    """with --async_train: load new weights between decode steps, generations in flight continue [--partial_rollout,
    --train.partial_rollout_enable]"""

    # RL: PPO-ptx (pretraining loss)
    pretrain_data: str | None = None
    """text for the PPO-ptx loss: files, folders or dataset names, comma-separated (text in --input_key)
    [--pretrain_data]"""
    pretrain_data_probs: str | None = None
    """sampling probabilities of --pretrain_data [--pretrain_data_probs]"""
    pretrain_split: str = "train"
    """split of --pretrain_data to read [--pretrain_split]"""
    ptx_coef: float | None = None
    """weight of the PPO-ptx loss (with --pretrain_data; default 0.05) [--ptx_coef]"""

    # RL: Ray placement, engines and weight sync
    actor_num_nodes: int = 1
    """nodes of the actor model's workers (train_ppo_ray) [--actor_num_nodes, --actor.num_nodes]"""
    actor_num_gpus_per_node: int = 1
    """GPUs per node of the actor model's workers (train_ppo_ray) [--actor_num_gpus_per_node,
    --actor.num_gpus_per_node]"""
    ref_num_nodes: int = 1
    """nodes of the ref model's workers (train_ppo_ray) [--ref_num_nodes, --ref.num_nodes]"""
    ref_num_gpus_per_node: int = 1
    """GPUs per node of the ref model's workers (train_ppo_ray) [--ref_num_gpus_per_node, --ref.num_gpus_per_node]"""
    critic_num_nodes: int = 1
    """nodes of the critic model's workers (train_ppo_ray) [--critic_num_nodes, --critic.num_nodes]"""
    critic_num_gpus_per_node: int = 1
    """GPUs per node of the critic model's workers (train_ppo_ray) [--critic_num_gpus_per_node,
    --critic.num_gpus_per_node]"""
    reward_num_nodes: int = 1
    """nodes of the reward model's workers (train_ppo_ray) [--reward_num_nodes, --reward.num_nodes]"""
    reward_num_gpus_per_node: int = 1
    """GPUs per node of the reward model's workers (train_ppo_ray) [--reward_num_gpus_per_node,
    --reward.num_gpus_per_node]"""
    vllm_num_engines: int = 1
    """rollout engines (each on --vllm_tensor_parallel_size GPUs) [--vllm_num_engines, --vllm.num_engines]"""
    vllm_tensor_parallel_size: int = 1
    """GPUs of one rollout engine (tensor parallel) [--vllm_tensor_parallel_size, --vllm.tensor_parallel_size]"""
    vllm_sync_backend: str = "nccl"
    """process-group backend of the weight broadcast to engines: nccl or gloo [--vllm_sync_backend,
    --vllm.sync_backend]"""
    vllm_sync_with_ray: bool = False
    """OpenRLHF: weight sync through ray.util.collective [--vllm_sync_with_ray, --vllm.sync_with_ray]"""
    weight_sync: Literal["auto", "object_store", "broadcast", "ipc"] = "auto"
    """policy -> engines weight sync after each step: broadcast (an NCCL group on GPUs, gloo on CPU), ipc (CUDA IPC
    handles, engines colocated with the policy), object_store (Ray's object store); auto: ipc when every engine
    shares a GPU with a policy rank, else broadcast [--weight_sync]"""
    weight_sync_bucket_mb: int = 256
    """weight sync bucket size in MB (one broadcast / IPC handle each) [--weight_sync_bucket_mb]"""
    vllm_gpu_memory_utilization: float = 0.95
    """fraction of GPU memory a vLLM engine may take [--vllm_gpu_memory_utilization, --vllm.gpu_memory_utilization]"""
    vllm_enable_sleep: bool = False
    """engines free their GPU memory (weights, KV cache) while the models train; train_ppo's engine frees its KV
    cache and decode graphs (and its own copy of the weights, if it has one) [--vllm_enable_sleep,
    --vllm.enable_sleep]"""
    enable_prefix_caching: bool = False
    """vLLM prefix caching (--rollout_engine vllm) [--enable_prefix_caching, --vllm.enable_prefix_caching]"""
    enforce_eager: bool = False
    """vLLM without CUDA graphs [--enforce_eager, --vllm.enforce_eager]"""
    colocate_all_models: bool = False
    """actor, reference, critic, reward model and engines share the same GPUs [--colocate_all_models,
    --train.colocate_all]"""
    colocate_actor_ref: bool = False
    """the reference model shares the actor's GPUs [--colocate_actor_ref, --train.colocate_actor_ref]"""
    colocate_critic_reward: bool = False
    """the reward model shares the critic's GPUs [--colocate_critic_reward, --train.colocate_critic_reward]"""
    deepspeed_enable_sleep: bool = False
    """training states (optimizer, fp32 master weights, gradients) to host memory between phases;
    --fsdp2_enable_sleep and --fsdp.enable_sleep are OpenRLHF's FSDP2-era names of the same flag
    [--deepspeed_enable_sleep, --ds.enable_sleep, --fsdp2_enable_sleep, --fsdp.enable_sleep]"""
    skip_memory_check: bool = False
    """start even when the per-GPU memory plan exceeds the GPU (train_ppo_ray prints the plan) [--skip_memory_check]"""

    # evaluation
    eval_steps: int = -1
    """evaluate every N steps (-1: never) [--eval_steps, --eval.steps]"""
    eval_split: str = "train"
    """split of --eval_dataset to read [--eval_split, --eval.split]"""
    eval_temperature: float = 0.6
    """sampling temperature of evaluation [--eval_temperature, --eval.temperature]"""
    eval_n_samples_per_prompt: int = 4
    """samples per evaluation prompt (pass@1 averages them, pass@n takes the best) [--eval_n_samples_per_prompt,
    --eval.n_samples_per_prompt]"""
    eval_max_samples: int | None = None
    """evaluate on at most this many prompts [--eval_max_samples]"""

    # checkpoints and output
    save_path: str = "./ckpt"
    """where the final model is saved in Hugging Face format [--save_path, --ckpt.output_dir]"""
    run_dir: str | None = None
    """metrics.jsonl, run_config.json and plots (default: --save_path) [--run_dir]"""
    overwrite_output_dir: bool = False
    """start over in a --save_path / --run_dir holding an earlier run: its metrics, run_config.json and the
    checkpoints inside it are removed (without it such a folder is refused) [--overwrite_output_dir,
    --ckpt.overwrite_output_dir]"""
    save_steps: int = -1
    """save a resumable checkpoint every N optimizer steps (-1: never) [--save_steps, --ckpt.save_steps]"""
    ckpt_path: str | None = None
    """folder of the resumable checkpoints (global_step<N>); default: <run dir>/checkpoints [--ckpt_path,
    --ckpt.path]"""
    max_ckpt_num: int = 3
    """keep this many newest checkpoints; older ones are deleted [--max_ckpt_num, --ckpt.max_num]"""
    max_ckpt_mem: float = 100000000.0
    """GB the resumable checkpoints in --ckpt_path may hold: after a save the oldest are deleted while they hold
    more (the one just saved always stays); as OpenRLHF's [--max_ckpt_mem, --ckpt.max_mem]"""
    load_checkpoint: bool = False
    """resume from the newest intact checkpoint in --ckpt_path, if there is one (none, and the output folders hold
    an earlier run: an error); its run's model, data, batch and learning-rate settings must be this run's
    [--load_checkpoint, --ckpt.load_enable]"""
    allow_resume_changes: str | None = None
    """--load_checkpoint: accept these settings (comma-separated flag names, or all) differing from the checkpoint's
    run as deliberate changes [--allow_resume_changes]"""
    save_hf_ckpt: bool = False
    """also save a Hugging Face snapshot with each checkpoint (<ckpt_path>/global_step<N>_hf) [--save_hf_ckpt,
    --ckpt.save_hf]"""
    hf_max_shard_size: str = "5GB"
    """largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes [--hf_max_shard_size]"""
    save_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """dtype of the saved Hugging Face model (auto: the dtype --pretrain's folder stores, else the compute dtype)
    [--save_dtype]"""
    disable_ds_ckpt: bool = False
    """--save_steps writes no resumable checkpoint (only --save_hf_ckpt snapshots) [--disable_ds_ckpt,
    --ckpt.disable_ds]"""
    stop_grace_s: float = 10.0
    """on SIGINT / SIGTERM the current step may finish within this many seconds (else it is abandoned); then a
    resumable checkpoint is written, the resume command printed, exit 130 / 143 [--stop_grace_s]"""
    best_metric_key: str = ""
    """eval metric that picks the best checkpoint ('': the first *_pass1 one; none: off) [--best_metric_key,
    --ckpt.best_metric_key]"""

    # logging
    logging_steps: int = 1
    """log metrics every N optimizer steps [--logging_steps, --logger.logging_steps]"""
    use_wandb: str | None = None
    """log to Weights & Biases: an API key, or 'True' to use the logged-in account [--use_wandb, --logger.wandb.key]"""
    wandb_org: str | None = None
    """wandb entity (team or user) [--wandb_org, --logger.wandb.org]"""
    wandb_group: str | None = None
    """wandb run group [--wandb_group, --logger.wandb.group]"""
    wandb_project: str = "rlhfkit_train_ppo"
    """wandb project [--wandb_project, --logger.wandb.project]"""
    wandb_run_name: str | None = None
    """wandb run name (default: wandb's), also the TensorBoard run's folder under --use_tensorboard
    [--wandb_run_name, --logger.wandb.run_name]"""
    use_tensorboard: str | None = None
    """write TensorBoard event files to <this folder>/<run name>: --wandb_run_name, else the run directory's name
    and the start time (needs tensorboard) [--use_tensorboard, --logger.tensorboard_dir]"""
    disable_progress: bool = False
    """no progress bar [--disable_progress]"""
    log_completions_steps: int = 10
    """every N RL steps (and at step 1) log a table of sampled prompts, completions, rewards and labels:
    completions.jsonl in the run directory, TensorBoard text, a wandb table, and its first rows on the console
    (0: off) [--log_completions_steps]"""
    log_completions_rows: int = 8
    """samples in each --log_completions_steps table, taken from as many prompts as possible
    [--log_completions_rows]"""

    # distributed backend
    backend: Literal["fsdp2", "deepspeed"] = "fsdp2"
    """training backend (fsdp2: PyTorch FSDP2, nothing extra to install) [--backend]"""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """sharding over data-parallel ranks, in DeepSpeed ZeRO terms: 0 replicate; 1/2 shard gradients and optimizer
    states; 3 shard the weights too [--zero_stage, --ds.zero_stage]"""
    local_rank: int = -1
    """OpenRLHF: this process's rank on its node; no effect in train_ppo: each process reads its rank from the
    environment (LOCAL_RANK / RANK, set by torchrun and the deepspeed launcher) [--local_rank]"""
    adam_offload: bool = False
    """keep optimizer states and fp32 master weights in host memory (CUDA only) [--adam_offload, --ds.adam_offload]"""
    packing_samples: bool = False
    """pack several samples into one row without padding (attention kept within each sample) [--packing_samples,
    --ds.packing_samples]"""
    ring_attn_size: int = 1
    """context parallelism: each sequence is split over this many ranks, whose attention passes key/value blocks
    round a ring (must divide the world size; 1: off) [--ring_attn_size, --ds.ring_attn_size]"""
    ring_head_stride: int = 1
    """key/value heads that go round the ring together with --ring_attn_size > 1 (must divide the model's key/value
    heads; larger: fewer, bigger ring passes) [--ring_head_stride, --ds.ring_attn_head_stride]"""
    ds_tensor_parallel_size: int = 1
    """tensor-parallel training size: attention heads, MLP and vocabulary split over this many ranks (Llama,
    Qwen2/3, Mistral), FSDP over the rest of the world [--ds_tensor_parallel_size, --ds.tensor_parallel_size]"""
    zpg: int = 1
    """OpenRLHF: ZeRO++ hierarchical partition size; no effect in train_ppo: a DeepSpeed setting; the FSDP2 backend
    has no equivalent [--zpg, --ds.zpg]"""
    overlap_comm: bool = False
    """OpenRLHF: overlap DeepSpeed's gradient reduction with the backward pass; no effect in train_ppo: a DeepSpeed
    setting; the FSDP2 backend has no equivalent [--overlap_comm, --ds.overlap_comm]"""
    grad_accum_dtype: str | None = None
    """OpenRLHF: DeepSpeed's gradient accumulation dtype; no effect in train_ppo: a DeepSpeed setting; the FSDP2
    backend has no equivalent [--grad_accum_dtype, --ds.grad_accum_dtype]"""
    deepcompile: bool = False
    """OpenRLHF: DeepSpeed's DeepCompile; no effect in train_ppo: a DeepSpeed setting; the FSDP2 backend has no
    equivalent [--deepcompile, --ds.deepcompile]"""
    use_universal_ckpt: bool = False
    """OpenRLHF: load DeepSpeed universal checkpoints; no effect in train_ppo: checkpoints
    (torch.distributed.checkpoint) load on any number of ranks without conversion [--use_universal_ckpt,
    --ds.use_universal_ckpt, --use_ds_universal_ckpt]"""
    device: str | None = None
    """cpu or cuda (default: cuda when available) [--device]"""

    # Hugging Face TRL's names for the same settings (init-only; reading one reads ours)
    output_dir: InitVar[str | None] = None
    """TRL's name for `save_path`"""
    learning_rate: InitVar[float | None] = None
    """TRL's name for `actor_learning_rate`"""
    per_device_train_batch_size: InitVar[int | None] = None
    """TRL's name for `micro_train_batch_size`"""
    num_generations: InitVar[int | None] = None
    """TRL's name for `n_samples_per_prompt`"""
    max_completion_length: InitVar[int | None] = None
    """TRL's name for `generate_max_len`"""
