"""Offline trainers of the Python API: SFT, reward model, DPO (IPO, cDPO), KTO.

    from rlhfkit import SFTConfig, SFTTrainer
    cfg = SFTConfig(max_len=64, learning_rate=1e-3, train_batch_size=32, micro_train_batch_size=32,
                    max_steps=100, save_path="ckpt/sft", device="cpu")
    history = SFTTrainer("base_model_dir", args=cfg, train_dataset=[{"input": "1+1=", "output": "2"}, ...]).train()

Each config's fields are the flags of its command (train_sft, train_rm, train_dpo, train_kto), inherited
from their declarations, with the command's defaults (rlhfkit.api.config); the trainer runs that
command's `run()`.

    DPO variants   DPOConfig(ipo=True) is IPO; DPOConfig(label_smoothing=0.1) is cDPO (conservative
                   DPO: labels flipped with that probability); nll_loss_coef adds the chosen NLL (RPO)
    reference      ref_model= (a directory or loaded model); default: the model itself, frozen
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rlhfkit.api.base import BaseTrainer
from rlhfkit.api.config import FlagConfig, TRLNames, api_config
from rlhfkit.api.inputs import model_input
from rlhfkit.config.configs import (BackendFlags, BatchConfig, BetaFlags, CheckpointFlags, DataFlags, LabelFlags,
                                    LearningRateFlags, LoggingFlags, ModelFlags, OfflineDataFlags, OptimFlags,
                                    PretrainModeFlags, RefModelFlags, ValueHeadFlags, VisionFlags)
from rlhfkit.config.flag_parser import ConsoleFlags
from rlhfkit.config.offline_flags import DPOFlags, KTOFlags, PairKeyFlags, RewardLossFlags, SFTFlags
from rlhfkit.models.given import GivenModels


OFFLINE_INPUTS = ("pretrain", "dataset", "eval_dataset")


@dataclass
class OfflineFlags(OfflineDataFlags, DataFlags, LearningRateFlags, OptimFlags, BatchConfig, BackendFlags,
                   CheckpointFlags, LoggingFlags, ModelFlags, ConsoleFlags):
    """The flags every offline command has (rlhfkit.cli.offline_common.add_offline_flags), less its inputs."""


@api_config
class SFTConfig(FlagConfig, TRLNames, SFTFlags, PretrainModeFlags, VisionFlags, OfflineFlags):
    """Supervised fine-tuning settings: the flags of `python -m rlhfkit.cli.train_sft` as fields.

    Rows: `input_key` (prompt) and `output_key` (answer), loss on the answer tokens; `pretrain_mode`:
    loss on every token; `multiturn`: conversations, loss on every assistant turn."""

    COMMAND: ClassVar[str] = "train_sft"
    INPUTS: ClassVar[tuple[str, ...]] = OFFLINE_INPUTS
    wandb_project: str = "rlhfkit_train_sft"


@api_config
class RewardConfig(FlagConfig, TRLNames, PairKeyFlags, ValueHeadFlags, RewardLossFlags, OfflineFlags):
    """Reward-model settings: the flags of `python -m rlhfkit.cli.train_rm` (pairwise Bradley-Terry loss)."""

    COMMAND: ClassVar[str] = "train_rm"
    INPUTS: ClassVar[tuple[str, ...]] = OFFLINE_INPUTS
    max_len: int = 512
    micro_train_batch_size: int = 1
    max_epochs: int = 1
    learning_rate: float = 9e-6
    wandb_project: str = "rlhfkit_train_rm"


@api_config
class DPOConfig(FlagConfig, TRLNames, PairKeyFlags, RefModelFlags, BetaFlags, DPOFlags, VisionFlags, OfflineFlags):
    """DPO settings: the flags of `python -m rlhfkit.cli.train_dpo`; `ipo=True` for IPO,
    `label_smoothing` > 0 for cDPO."""

    COMMAND: ClassVar[str] = "train_dpo"
    INPUTS: ClassVar[tuple[str, ...]] = OFFLINE_INPUTS
    max_len: int = 512
    eval_split: str = "test"
    max_epochs: int = 1
    learning_rate: float = 1e-5
    wandb_project: str = "rlhfkit_train_dpo"


@api_config
class KTOConfig(FlagConfig, TRLNames, RefModelFlags, BetaFlags, KTOFlags, LabelFlags, OfflineFlags):
    """KTO settings: the flags of `python -m rlhfkit.cli.train_kto` (unpaired rows with a boolean `label_key`)."""

    COMMAND: ClassVar[str] = "train_kto"
    INPUTS: ClassVar[tuple[str, ...]] = OFFLINE_INPUTS
    output_key: str | None = "output"
    label_key: str | None = "label"
    beta: float = 0.01
    max_epochs: int = 1
    learning_rate: float = 1e-5
    wandb_project: str = "rlhfkit_train_kto"


class SFTTrainer(BaseTrainer):
    """`SFTTrainer(model, args=SFTConfig(...), train_dataset=..., eval_dataset=None, processing_class=None)`;
    `on_step_end(state, metrics, backend)` runs after each step (returning True stops early)."""

    config_class = SFTConfig

    def __init__(self, model: Any, args: SFTConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, tokenizer: Any = None,
                 on_step_end: Any = None) -> None:
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, tokenizer)
        self.on_step_end = on_step_end

    def _run(self, ns: Any, parser: Any) -> Any:
        from rlhfkit.cli import train_sft

        return train_sft.run(ns, on_step_end=self.on_step_end, given=self._given())


class RewardTrainer(BaseTrainer):
    """`RewardTrainer(model, args=RewardConfig(...), train_dataset=pairs)`: a value head on `model`,
    trained on chosen/rejected pairs; the saved model loads as AutoModelForSequenceClassification."""

    config_class = RewardConfig


class _WithRef(BaseTrainer):
    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, tokenizer: Any = None) -> None:
        super().__init__(model, args, train_dataset, eval_dataset, processing_class, tokenizer)
        self.ref_model = ref_model
        self._ref_path: str | None = None
        self._ref_module: Any = None
        if ref_model is not None:
            self._ref_path, self._ref_module = model_input(ref_model, "ref_model")

    def _inputs(self) -> dict[str, Any]:
        out = super()._inputs()
        if self._ref_path is not None:
            out["ref_pretrain"] = self._ref_path
        return out

    def _given(self) -> GivenModels:
        return GivenModels(policy=self._module, tokenizer=self._tokenizer, ref=self._ref_module)


class DPOTrainer(_WithRef):
    """`DPOTrainer(model, ref_model=None, args=DPOConfig(...), train_dataset=pairs)`; the reference is
    `ref_model` (default: `model`, frozen)."""

    config_class = DPOConfig


class KTOTrainer(_WithRef):
    """`KTOTrainer(model, ref_model=None, args=KTOConfig(...), train_dataset=rows)` (rows: input, output, label)."""

    config_class = KTOConfig


__all__ = ["SFTConfig", "SFTTrainer", "RewardConfig", "RewardTrainer", "DPOConfig", "DPOTrainer",
           "KTOConfig", "KTOTrainer"]
