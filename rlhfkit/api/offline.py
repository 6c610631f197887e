"""Offline trainers of the Python API: SFT, reward model, DPO (IPO, cDPO), KTO.

    from rlhfkit import SFTConfig, SFTTrainer
    cfg = SFTConfig(max_len=64, learning_rate=1e-3, train_batch_size=32, micro_train_batch_size=32,
                    max_steps=100, save_path="ckpt/sft", device="cpu")
    history = SFTTrainer("base_model_dir", args=cfg, train_dataset=[{"input": "1+1=", "output": "2"}, ...]).train()

Each config's fields are the flags of its command (train_sft, train_rm, train_dpo, train_kto)
with the same defaults (rlhfkit.api.config); the trainer runs that command's `run()`.

    DPO variants   DPOConfig(ipo=True) is IPO; DPOConfig(label_smoothing=0.1) is cDPO (conservative
                   DPO: labels flipped with that probability); nll_loss_coef adds the chosen NLL (RPO)
    reference      ref_model= (a directory or loaded model); default: the model itself, frozen
"""

from __future__ import annotations

from typing import Any

from rlhfkit.api.base import BaseTrainer
from rlhfkit.api.flag_fields import TrainDPOFields, TrainKTOFields, TrainRMFields, TrainSFTFields
from rlhfkit.api.inputs import model_input
from rlhfkit.models.given import GivenModels


class SFTConfig(TrainSFTFields):
    """Supervised fine-tuning settings: the flags of `python -m rlhfkit.cli.train_sft` as fields.

    Rows: `input_key` (prompt) and `output_key` (answer), loss on the answer tokens; `pretrain_mode`:
    loss on every token; `multiturn`: conversations, loss on every assistant turn."""


class RewardConfig(TrainRMFields):
    """Reward-model settings: the flags of `python -m rlhfkit.cli.train_rm` (pairwise Bradley-Terry loss)."""


class DPOConfig(TrainDPOFields):
    """DPO settings: the flags of `python -m rlhfkit.cli.train_dpo`; `ipo=True` for IPO,
    `label_smoothing` > 0 for cDPO."""


class KTOConfig(TrainKTOFields):
    """KTO settings: the flags of `python -m rlhfkit.cli.train_kto` (unpaired rows with a boolean `label_key`)."""


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
