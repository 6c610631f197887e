"""Typed per-component configs: the declarations of their flags (rlhfkit.config.declare), built from the parsed flags.

Components take one of these (plus explicit objects), never the argparse namespace. A field declared
with `flag(...)` is the one declaration of its flag: the parsers add it with `add_fields`
(rlhfkit.config.flags); a field that mirrors a setting declared elsewhere takes its default from
there (`default_of`).
`from_args(ns)` copies the fields whose names match flag dests; any field may be
overridden by keyword, which is how one CLI builds two configs from different flags
(the PPO actor and critic learning rates, say).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from rlhfkit.config.declare import Switch, default_of, flag
from rlhfkit.config.flag_parser import BACKEND, CKPT, DATA, EVAL, LOGGING, LORA, MODEL, OPTIM, RL_REWARD, TRAIN

T = TypeVar("T")


def from_args(cls: type[T], ns: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Build dataclass `cls` from namespace attributes with the same names, then overrides."""
    kw: dict[str, Any] = {}
    if ns is not None:
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if hasattr(ns, f.name):
                kw[f.name] = getattr(ns, f.name)
    kw.update(overrides)
    return cls(**kw)  # type: ignore[call-arg]


@dataclass
class InputsConfig:
    """The inputs of the commands: the model, the data and the reward source. The Python API's trainers take
    them as arguments (objects or paths), so they are no fields of its configs."""

    pretrain: str | None = flag(
        None, "--model.model_name_or_path", "--actor.model_name_or_path", group=MODEL,
        help="the model to train or run: a Hugging Face model directory, or a hub id (org/name: the HF cache, else "
             "the hub when online)")
    dataset: str | None = flag(
        None, "--data.dataset", group=DATA,
        help="training data: comma-separated .jsonl/.json/.parquet/.csv files, folders or dataset names")
    prompt_data: str | None = flag(
        None, "--data.prompt_dataset",
        help="prompts: comma-separated .jsonl/.json/.parquet/.csv files, folders or dataset names")
    eval_dataset: str | None = flag(
        None, "--eval.dataset", group=EVAL,
        help="evaluation data, same format as --dataset (default: no evaluation)")
    remote_rm_url: str | None = flag(
        None, "--reward.remote_url", group=RL_REWARD,
        help="http(s) reward server URL(s), comma-separated, or a .py file defining reward_func(queries, prompts, "
             "labels)")


@dataclass
class ModelFlags:
    """How the model is loaded and trained (dtype, attention kernel, LoRA): the model and LoRA groups' flags."""

    param_dtype: Literal["bf16", "fp16", "fp32"] = flag(
        "bf16", "--ds.param_dtype", "--fsdp.param_dtype", group=MODEL,
        help="compute dtype on GPU (master weights stay fp32); CPU training computes in fp32",
        switches=(Switch("--bf16", "bf16", "alias of --param_dtype bf16"),))
    attn_implementation: str = flag(
        "sdpa", "--ds.attn_implementation", "--fsdp.attn_implementation",
        help="attention kernel of transformers: sdpa, eager, flash_attention_2 (when installed)",
        switches=(Switch("--flash_attn", "flash_attention_2", "alias of --attn_implementation flash_attention_2"),))
    gradient_checkpointing: bool = flag(
        False, "--model.gradient_checkpointing_enable", "--actor.gradient_checkpointing_enable",
        help="recompute activations in the backward pass: less memory, about a third more compute")
    mixed_precision: Literal["master_weights", "autocast"] = flag(
        "master_weights",
        help="one process with bf16/fp16 compute: master_weights (module in the compute dtype, fp32 copies in the "
             "optimizer) or autocast (fp32 module under torch.autocast)")
    torch_compile: bool = flag(False, help="torch.compile each transformer block of trained models")
    gradient_checkpointing_use_reentrant: bool = flag(
        False, "--model.gradient_checkpointing_reentrant", "--actor.gradient_checkpointing_reentrant",
        help="with --gradient_checkpointing: torch's reentrant checkpoint variant (the default is the non-reentrant "
             "one)")
    disable_fast_tokenizer: bool = flag(
        False, "--data.disable_fast_tokenizer", help="load the slow (Python) tokenizer instead of the fast (Rust) one")
    use_liger_kernel: bool = flag(
        False, "--ds.use_liger_kernel", help="OpenRLHF: Liger's fused kernels",
        inert="Liger kernels are not used; the log-prob kernel is fused already (rlhfkit.models.fused_logprobs)")
    aux_loss_coef: float = flag(
        0.0, "--model.aux_loss_coef", "--actor.aux_loss_coef",
        help="weight of a mixture-of-experts model's router load-balancing loss (0: off)")
    experts_implementation: str | None = flag(
        None, "--ds.experts_implementation",
        help="mixture-of-experts kernels of transformers: eager, batched_mm, grouped_mm, deepgemm (default: the "
             "model's own)")
    use_ms: bool = flag(False, help="download model ids from ModelScope (needs modelscope)")
    lora_rank: int = flag(
        0, "--ds.lora.rank", group=LORA,
        help="rank of LoRA adapters on the trained model (0: train all weights); the saved model is the adapter "
             "(peft format)")
    lora_alpha: int = flag(16, "--ds.lora.alpha",
                           help="LoRA scaling numerator: the adapter's update is scaled by alpha / rank")
    target_modules: list[str] = flag(
        ["all-linear"], "--ds.lora.target_modules",
        help="module names that get LoRA adapters (peft's target_modules; all-linear: every linear layer but the "
             "output head)")
    lora_dropout: float = flag(0.0, "--ds.lora.dropout", help="dropout probability on the LoRA adapters' input")
    load_in_4bit: bool = flag(
        False, "--ds.load_in_4bit",
        help="QLoRA: load the frozen base weights in 4-bit NF4 (needs bitsandbytes; on CPU 0.48 or newer; use with --lora_rank)")


@dataclass
class VisionFlags:
    """Vision-language data and models (docs/vlm.md): the pictures of a row, their limits, and whether the
    vision tower trains."""

    image_key: str = flag(
        "images", "--data.image_key", group=DATA,
        help="column with a row's pictures: file paths, http(s) URLs, base64 data URIs or image bytes (one, or a list)")
    max_images_per_prompt: int = flag(
        0, "--data.max_images_per_prompt",
        help="> 0 turns on vision-language mode: pictures of --image_key go with each sample, at most this many (a "
             "row with more is an error)")
    image_failure: Literal["stop", "drop"] = flag(
        "stop",
        help="a missing, unreadable or too large picture: stop with an error naming file and row, or drop its row "
             "(counted)")
    max_image_bytes: int = flag(32 * 2**20, help="largest picture file in bytes")
    max_image_pixels: int = flag(4096 * 4096, help="largest picture in pixels (width x height)")
    freeze_visual_encoder: bool = flag(
        False, "--actor.freeze_visual_encoder", group=MODEL,
        help="vision-language models: the vision tower does not train (nor go to the rollout engines); the language "
             "model and its head do")


@dataclass
class ModelConfig(ModelFlags):
    """The model to load and how: what the model loader takes (rlhfkit.models.loader)."""

    pretrain: str | None = default_of(InputsConfig, "pretrain")
    freeze_visual_encoder: bool = default_of(VisionFlags, "freeze_visual_encoder")


# --lr_scheduler: the names of transformers.SchedulerType that need nothing but warm-up and total steps
# (and --min_lr_ratio); reduce_lr_on_plateau needs a metric, warmup_stable_decay its own phase lengths
LRSchedule = Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup",
                     "cosine_with_restarts", "polynomial", "inverse_sqrt", "cosine_warmup_with_min_lr"]
OPTIM_HELP = ("optimizer: adam (AdamW); adamw_8bit: AdamW whose two moments are stored in 8 bits per value (blockwise "
              "float8 codes, 2.03 bytes a parameter instead of 8); or muon: Muon for the 2-D weights of hidden layers, "
              "AdamW for the rest")
MASTER_WEIGHTS_HELP = (
    "trainable weights: fp32 master weights (the compute copy in --param_dtype); bf16_stochastic: bf16 weights and "
    "gradients, no fp32 copy, each update rounded stochastically; bf16_kahan: the same with a bf16 compensation of the "
    "rounding error (2 more bytes a parameter). The bf16 modes need --param_dtype bf16 and --optim adam or adamw_8bit")


@dataclass
class LearningRateFlags:
    """The offline commands' learning rate (the RL commands have one per model: rl_flags.RLTrainFlags)."""

    learning_rate: float = flag(5e-6, "--adam.lr", group=OPTIM, help="peak learning rate")


@dataclass
class OptimFlags:
    """The optimizer, its schedule and the step guard's limits (rlhfkit.backend.optim, rlhfkit.backend.guard).
    The RL commands name the policy's with --actor.*."""

    adam_betas: list[float] = flag([0.9, 0.95], "--adam.betas", "--actor.adam.betas", nargs=2, group=OPTIM,
                                   help="AdamW beta1 beta2")
    adam_eps: float = flag(1e-8, "--adam.eps", "--actor.adam.eps", help="AdamW epsilon")
    l2: float = flag(0.0, "--adam.weight_decay", "--actor.adam.weight_decay", help="AdamW weight decay")
    optim: Literal["adam", "adamw_8bit", "muon"] = flag("adam", "--actor.optim", help=OPTIM_HELP)
    master_weights: Literal["fp32", "bf16_stochastic", "bf16_kahan"] = flag(
        "fp32", "--actor.master_weights", help=MASTER_WEIGHTS_HELP)
    muon_lr: float = flag(0.02, "--muon.lr", "--actor.muon.lr", help="Muon learning rate (--optim muon)")
    muon_momentum: float = flag(0.95, "--muon.momentum", "--actor.muon.momentum", help="Muon momentum")
    muon_ns_steps: int = flag(5, "--muon.ns_steps", "--actor.muon.ns_steps",
                              help="Muon: Newton-Schulz iterations that orthogonalise the update")
    muon_nesterov: bool = flag(
        True, "--muon.nesterov", "--actor.muon.nesterov", help="Muon: Nesterov momentum (default)",
        switches=(Switch(("--muon_no_nesterov", "--muon.no_nesterov", "--actor.muon.no_nesterov"), False,
                         "Muon: plain momentum"),))
    lr_scheduler: LRSchedule = flag(
        "cosine_with_min_lr", "--actor.lr_scheduler",
        help="learning-rate schedule (transformers.get_scheduler), after a linear warm-up from 0")
    lr_warmup_ratio: float = flag(0.03, "--actor.lr_warmup_ratio",
                                  help="fraction of the optimizer steps spent warming up linearly from 0")
    min_lr_ratio: float = flag(
        0.1, "--actor.min_lr_ratio",
        help="cosine_with_min_lr, cosine_warmup_with_min_lr: the learning rate ends at this fraction of the peak")
    max_norm: float = flag(1.0, "--actor.max_norm", help="clip the gradient's global L2 norm to this (0 disables)")
    max_nonfinite_steps: int = flag(
        3,
        help="optimizer steps with a non-finite loss or gradient are skipped; more than this many in a row (or a "
             "non-finite weight) stop the run with exit code 1, nothing saved")
    max_weight_growth: float = flag(
        100.0,
        help="a trainable weight whose magnitude exceeds this many times the largest at the start of training (at "
             "least 1) stops the run with exit code 1, nothing saved (0: off)")
    max_zero_grad_steps: int = flag(
        3,
        help="more than this many optimizer steps in a row whose gradient is exactly 0 while the loss is not (a "
             "saturated model) stop the run with exit code 1, nothing saved (-1: off)")


@dataclass
class OptimConfig(OptimFlags, LearningRateFlags):
    """What the optimizer and its schedule take (rlhfkit.backend.optim)."""


DS_ONLY = "a DeepSpeed setting; the FSDP2 backend has no equivalent"


@dataclass
class BackendFlags:
    """How a model is wrapped and trained (FSDP2 by default): sharding, parallel sizes, device, seed, export."""

    backend: Literal["fsdp2", "deepspeed"] = flag(
        "fsdp2", group=BACKEND, help="training backend (fsdp2: PyTorch FSDP2, nothing extra to install)")
    zero_stage: Literal[0, 1, 2, 3] = flag(
        2, "--ds.zero_stage",
        help="sharding over data-parallel ranks, in DeepSpeed ZeRO terms: 0 replicate; 1/2 shard gradients and "
             "optimizer states; 3 shard the weights too")
    local_rank: int = flag(
        -1, help="OpenRLHF: this process's rank on its node",
        inert="each process reads its rank from the environment (LOCAL_RANK / RANK, set by torchrun and the "
              "deepspeed launcher)")
    adam_offload: bool = flag(False, "--ds.adam_offload",
                              help="keep optimizer states and fp32 master weights in host memory (CUDA only)")
    packing_samples: bool = flag(
        False, "--ds.packing_samples",
        help="pack several samples into one row without padding (attention kept within each sample)")
    ring_attn_size: int = flag(
        1, "--ds.ring_attn_size",
        help="context parallelism: each sequence is split over this many ranks, whose attention passes key/value "
             "blocks round a ring (must divide the world size; 1: off)")
    ring_head_stride: int = flag(
        1, "--ds.ring_attn_head_stride",
        help="key/value heads that go round the ring together with --ring_attn_size > 1 (must divide the model's "
             "key/value heads; larger: fewer, bigger ring passes)")
    ds_tensor_parallel_size: int = flag(
        1, "--ds.tensor_parallel_size",
        help="tensor-parallel training size: attention heads, MLP and vocabulary split over this many ranks (Llama, "
             "Qwen2/3, Mistral), FSDP over the rest of the world")
    zpg: int = flag(1, "--ds.zpg", help="OpenRLHF: ZeRO++ hierarchical partition size", inert=DS_ONLY)
    overlap_comm: bool = flag(False, "--ds.overlap_comm", inert=DS_ONLY,
                              help="OpenRLHF: overlap DeepSpeed's gradient reduction with the backward pass")
    grad_accum_dtype: str | None = flag(None, "--ds.grad_accum_dtype", inert=DS_ONLY,
                                        help="OpenRLHF: DeepSpeed's gradient accumulation dtype")
    deepcompile: bool = flag(False, "--ds.deepcompile", help="OpenRLHF: DeepSpeed's DeepCompile", inert=DS_ONLY)
    use_universal_ckpt: bool = flag(
        False, "--ds.use_universal_ckpt", "--use_ds_universal_ckpt",
        help="OpenRLHF: load DeepSpeed universal checkpoints",
        inert="checkpoints (torch.distributed.checkpoint) load on any number of ranks without conversion")
    device: str | None = flag(None, help="cpu or cuda (default: cuda when available)")
    seed: int = flag(42, "--train.seed", group=TRAIN, help="seed of python, numpy, torch and data shuffling")
    full_determinism: bool = flag(
        False, "--train.full_determinism_enable",
        help="deterministic torch algorithms (transformers.enable_full_determinism): reproducible, slower")
    hf_max_shard_size: str = flag(
        "5GB", group=CKPT, help="largest safetensors file of a Hugging Face export, e.g. 5GB, 500MB or bytes")
    save_dtype: Literal["auto", "bf16", "fp16", "fp32"] = flag(
        "auto",
        help="dtype of the saved Hugging Face model (auto: the dtype --pretrain's folder stores, else the compute "
             "dtype)")


@dataclass
class BackendConfig(BackendFlags):
    """What a training backend takes (rlhfkit.backend.fsdp2): its flags and the model's settings it applies."""

    param_dtype: str = default_of(ModelConfig, "param_dtype")
    gradient_checkpointing: bool = default_of(ModelConfig, "gradient_checkpointing")
    mixed_precision: str = default_of(ModelConfig, "mixed_precision")  # see ModelConfig.mixed_precision
    torch_compile: bool = default_of(ModelConfig, "torch_compile")
    # the compiled blocks' shapes: None lets torch decide (static, then dynamic after a second shape);
    # True compiles for any sequence length at once (RL: every step's lengths differ). Not a flag.
    compile_dynamic: bool | None = None
    # EMA of the trainable weights (--enable_ema --ema_beta; the policy only): None is off. Not named
    # after a flag, so `from_args` never turns it on for a critic or reference model.
    ema_decay: float | None = None
    # checkpoints under a --ckpt_path may hold this many GB (OpenRLHF's unit), oldest go first; None: no
    # limit (the flag --max_ckpt_mem is CheckpointConfig's, whose default is OpenRLHF's 1e8)
    max_ckpt_mem: float | None = None


@dataclass
class BatchConfig:
    """Global and per-rank batch sizes (`grad_accum_steps` derives from them) and how long to train."""

    train_batch_size: int = flag(
        128, "--train.batch_size", group=TRAIN,
        help="global samples per optimizer step (all ranks together; gradient accumulation makes up the rest)")
    micro_train_batch_size: int = flag(8, "--train.micro_batch_size",
                                       help="samples per forward/backward pass on each rank")
    max_epochs: int = flag(2, "--train.max_epochs", help="passes over the data")
    max_steps: int | None = flag(
        None, help="optimizer steps to take, cycling the data as often as needed (overrides --max_epochs)")

    def grad_accum_steps(self, world_size: int) -> int:
        per_step = self.micro_train_batch_size * world_size
        if self.train_batch_size % per_step != 0:
            raise ValueError(
                f"--train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"--micro_train_batch_size ({self.micro_train_batch_size}) x world size ({world_size}) "
                f"= {per_step}"
            )
        return self.train_batch_size // per_step


@dataclass
class CheckpointFlags:
    """Where a run's model, checkpoints and records go, and how checkpoints are kept and resumed."""

    save_path: str = flag("./ckpt", "--ckpt.output_dir", group=CKPT,
                          help="where the final model is saved in Hugging Face format")
    run_dir: str | None = flag(None, help="metrics.jsonl, run_config.json and plots (default: --save_path)")
    overwrite_output_dir: bool = flag(
        False, "--ckpt.overwrite_output_dir",
        help="start over in a --save_path / --run_dir holding an earlier run: its metrics, run_config.json and the "
             "checkpoints inside it are removed (without it such a folder is refused)")
    save_steps: int = flag(-1, "--ckpt.save_steps",
                           help="save a resumable checkpoint every N optimizer steps (-1: never)")
    ckpt_path: str | None = flag(
        None, "--ckpt.path",
        help="folder of the resumable checkpoints (global_step<N>); default: <run dir>/checkpoints")
    max_ckpt_num: int = flag(3, "--ckpt.max_num", help="keep this many newest checkpoints; older ones are deleted")
    max_ckpt_mem: float = flag(
        1e8, "--ckpt.max_mem",
        help="GB the resumable checkpoints in --ckpt_path may hold: after a save the oldest are deleted while they "
             "hold more (the one just saved always stays); as OpenRLHF's")
    load_checkpoint: bool = flag(
        False, "--ckpt.load_enable",
        help="resume from the newest intact checkpoint in --ckpt_path, if there is one (none, and the output "
             "folders hold an earlier run: an error); its run's model, data, batch and learning-rate settings must "
             "be this run's")
    allow_resume_changes: str | None = flag(
        None,
        help="--load_checkpoint: accept these settings (comma-separated flag names, or all) differing from the "
             "checkpoint's run as deliberate changes")
    save_hf_ckpt: bool = flag(
        False, "--ckpt.save_hf",
        help="also save a Hugging Face snapshot with each checkpoint (<ckpt_path>/global_step<N>_hf)")
    disable_ds_ckpt: bool = flag(False, "--ckpt.disable_ds",
                                 help="--save_steps writes no resumable checkpoint (only --save_hf_ckpt snapshots)")
    stop_grace_s: float = flag(
        10.0,
        help="on SIGINT / SIGTERM the current step may finish within this many seconds (else it is abandoned); then "
             "a resumable checkpoint is written, the resume command printed, exit 130 / 143")


@dataclass
class OutputPathFlags:
    """The file a tool command (batch_inference, lora_combiner) writes."""

    output_path: str | None = flag(None, help="the file or folder the command writes")


@dataclass
class LoggingFlags:
    """Metrics and where they go: the console, wandb, TensorBoard; how often, and how often to evaluate."""

    logging_steps: int = flag(1, "--logger.logging_steps", group=LOGGING, help="log metrics every N optimizer steps")
    use_wandb: str | None = flag(
        None, "--logger.wandb.key", help="log to Weights & Biases: an API key, or 'True' to use the logged-in account")
    wandb_org: str | None = flag(None, "--logger.wandb.org", help="wandb entity (team or user)")
    wandb_group: str | None = flag(None, "--logger.wandb.group", help="wandb run group")
    wandb_project: str = flag("rlhfkit", "--logger.wandb.project", help="wandb project")
    wandb_run_name: str | None = flag(
        None, "--logger.wandb.run_name",
        help="wandb run name (default: wandb's), also the TensorBoard run's folder under --use_tensorboard")
    use_tensorboard: str | None = flag(
        None, "--logger.tensorboard_dir",
        help="write TensorBoard event files to <this folder>/<run name>: --wandb_run_name, else the run directory's "
             "name and the start time (needs tensorboard)")
    disable_progress: bool = flag(False, help="no progress bar")
    eval_steps: int = flag(-1, "--eval.steps", group=EVAL, help="evaluate every N steps (-1: once per epoch)")


DEFAULT_INPUT_TEMPLATE: str | None = None  # every command: the prompt as it is (rlhfkit.data.templates)


@dataclass
class DataFlags:
    """How rows become samples: columns, templates, length and size limits; the evaluation data's split."""

    input_key: str = flag("input", "--data.input_key", group=DATA,
                          help="column with the prompt (or the whole text / conversation)")
    input_template: str | None = flag(
        DEFAULT_INPUT_TEMPLATE, "--data.input_template",
        help="format of the prompt with one {} for the --input_key text (default, or '': the text as it is)")
    apply_chat_template: bool = flag(
        False, "--data.apply_chat_template",
        help="format prompts and conversations with the tokenizer's chat template (off: one line says when the "
             "tokenizer has one)")
    tokenizer_chat_template: str | None = flag(None, "--data.tokenizer_chat_template",
                                               help="a Jinja chat template that replaces the tokenizer's own")
    max_len: int = flag(2048, "--data.max_len",
                        help="longest sample in tokens; longer samples are dropped (counted and reported)")
    max_samples: int = flag(1_000_000, "--data.max_samples",
                            help="read at most this many rows of the data (after mixing)")
    max_row_bytes: int = flag(1_000_000, "--data.max_row_bytes",
                              help="largest input row in bytes; a larger row is an error naming file and row")
    dataloader_num_workers: int = flag(
        0, "--data.dataloader_num_workers", help="OpenRLHF: DataLoader worker processes",
        inert="data is tokenized once up front and batched in the training process (no loader workers)")
    eval_split: str = flag("train", "--eval.split", group=EVAL, help="split of --eval_dataset to read")


@dataclass
class OfflineDataFlags:
    """The offline commands' --dataset: its mixing probabilities, split and response column."""

    dataset_probs: str | None = flag(
        None, "--data.dataset_probs", group=DATA,
        help="comma-separated sampling probabilities, one per --dataset entry (default: concatenate)")
    dataset_split: str = flag("train", "--data.dataset_split", "--train_split",
                              help="split of --dataset to read (for datasets with splits)")
    output_key: str | None = flag(None, "--data.output_key",
                                  help="column with the response (see the command's description)")


@dataclass
class LabelFlags:
    """A label column (KTO, PRM, the RL reward's label)."""

    label_key: str | None = flag(None, "--data.label_key", group=DATA, help="column with the label")


@dataclass
class RewardModelFlags:
    """Reward models (RL; batch_inference and serve_rm score with one)."""

    reward_pretrain: str | None = flag(
        None, "--reward.model_name_or_path",
        help="reward model directory or hub id (a sequence classifier with one output); several, comma-separated, "
             "are summed")
    normalize_reward: bool = flag(False, "--reward.normalize_enable",
                                  help="normalise reward-model scores with the mean / std stored in its config")


@dataclass
class ValueHeadFlags:
    value_head_prefix: str = flag("score", "--ds.value_head_prefix", "--value_prefix_head",
                                  help="name of the reward / critic model's value head module")


@dataclass
class RefModelFlags:
    """The reference model (DPO / KTO, the RL KL term)."""

    ref_pretrain: str | None = flag(None, "--ref.model_name_or_path",
                                    help="reference model directory or hub id (default: --pretrain)")
    ref_offload: bool = flag(False, "--ref.offload",
                             help="keep the reference model in host memory between its forward passes")


@dataclass
class BetaFlags:
    beta: float = flag(0.1, "--model.beta", help="the loss's beta (DPO / KTO; each command sets its default)")


@dataclass
class PretrainModeFlags:
    pretrain_mode: bool = flag(False, "--model.pretrain_mode_enable",
                               help="loss on every token of the raw text (no template)")


ROLLOUT_ENGINE_HELP = ("generation engine: builtin (continuous batching, no extra package), hf (transformers generate, "
                       "slow reference) or vllm (when installed); auto: builtin when it supports the model, else vllm "
                       "when installed, else hf")


@dataclass
class SamplingFlags:
    """Generation: the engine, how many prompts at once, their lengths and the sampling (train_ppo's rollout,
    batch_inference, interactive_chat)."""

    rollout_engine: Literal["auto", "builtin", "hf", "vllm"] = flag("auto", help=ROLLOUT_ENGINE_HELP)
    rollout_batch_size: int = flag(1024, "--rollout.batch_size", help="prompts per RL step")
    prompt_max_len: int = flag(1024, help="longest prompt in tokens; longer prompts are dropped (counted)")
    generate_max_len: int | None = flag(
        None, "--max_new_tokens", "--rollout.max_new_tokens",
        help="new tokens of one generation (default: 1024; with --max_len given, what --max_len leaves after the "
             "prompt, as OpenRLHF's --rollout.max_new_tokens)")
    temperature: float = flag(1.0, "--rollout.temperature", help="sampling temperature")
    top_p: float = flag(1.0, "--rollout.top_p", help="nucleus sampling: keep this probability mass")
    enable_prefix_caching: bool = flag(False, "--vllm.enable_prefix_caching",
                                       help="vLLM prefix caching (--rollout_engine vllm)")


@dataclass
class ChatSamplingFlags:
    """Sampling settings of the commands that only generate (batch_inference, interactive_chat)."""

    greedy_sampling: bool = flag(False, help="greedy decoding (temperature 0)")
    repetition_penalty: float = flag(
        1.0, help="1.0 = none; > 1 discourages repeating tokens of the prompt and the completion")
