"""The offline commands' own flags (train_sft, train_rm, train_dpo, train_kto, train_kd, train_prm), declared as fields
(rlhfkit.config.declare); the shared ones are rlhfkit.config.configs'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhfkit.config.declare import flag
from rlhfkit.config.flag_parser import DATA


@dataclass
class SFTFlags:
    multiturn: bool = flag(False, "--data.multiturn",
                           help="--input_key holds a conversation; the loss covers every assistant turn")


@dataclass
class PairKeyFlags:
    """Paired preference columns (reward model, DPO)."""

    prompt_key: str | None = flag(None, "--data.prompt_key", group=DATA,
                                  help="prompt column; without it chosen/rejected are whole texts or conversations")
    chosen_key: str = flag("chosen", "--data.chosen_key",
                           help="column with the preferred answer (or whole text / conversation)")
    rejected_key: str = flag("rejected", "--data.rejected_key",
                             help="column with the dispreferred answer (or whole text / conversation)")


@dataclass
class RewardLossFlags:
    """train_rm's loss."""

    loss: Literal["sigmoid", "logexp"] = flag(
        "sigmoid", "--model.loss_type",
        help="sigmoid: -log sigmoid(r_c - r_r - margin); logexp: log(1 + exp(r_r - r_c))")
    margin_loss: bool = flag(False, "--model.margin_loss_enable",
                             help="subtract each row's `margin` column inside the sigmoid loss")
    compute_fp32_loss: bool = flag(False, "--model.compute_fp32_loss_enable", help="",
                                   inert="rewards and the loss are always computed in fp32")


@dataclass
class DPOFlags:
    """train_dpo's loss variants: IPO, cDPO (label smoothing), the chosen answers' NLL."""

    ipo: bool = flag(False, "--model.ipo_enable", help="IPO loss: (z - 1 / (2 beta))^2")
    label_smoothing: float = flag(0.0, "--model.label_smoothing",
                                  help="cDPO: probability that a preference label is flipped, in [0, 0.5]")
    nll_loss_coef: float = flag(0.0, "--model.nll_loss_coef",
                                help="weight of the chosen answers' NLL (Llama 3.1 / RPO style)")


@dataclass
class KTOFlags:
    """train_kto's weights of the two kinds of answers."""

    desirable_loss_weight: float = flag(1.0, "--model.desirable_loss_weight",
                                        help="weight of the loss on desirable answers (lambda_D of the KTO paper)")
    undesirable_loss_weight: float = flag(1.0, "--model.undesirable_loss_weight",
                                          help="weight of the loss on undesirable answers (lambda_U of the KTO paper)")


@dataclass
class KDFlags:
    """train_kd's teacher and the weight of its term."""

    teacher_model: str | None = flag(None, "--teacher.model_name_or_path",
                                     help="frozen teacher model directory or hub id (same vocabulary as --pretrain)")
    kd_coef: float = flag(0.4, "--model.kd_coef", help="weight of the KD term, in [0, 1]")
    teacher_offload: bool = flag(False, "--teacher.offload",
                                 help="keep the teacher in CPU memory between its forward passes")


@dataclass
class PRMFlags:
    """train_prm's step tokens."""

    placeholder_token: str | None = flag(None, "--data.placeholder_token",
                                         help="the single token that ends each step, e.g. 'ки' (Math-Shepherd)")
    reward_tokens: list[str] | None = flag(
        None, "--data.reward_tokens", help="label tokens, e.g. + - (none: labels are scored over the whole vocabulary)")
