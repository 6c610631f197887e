"""rlhfkit.data: rows -> tokenized items -> batches.

    --dataset files/folders/names --> io.load_mixture --> list[Row] (data + file + row number)
    Row --> SFTDataset / PreferenceDataset / UnpairedDataset / PRMDataset / PromptDataset
         (templates.py: --input_template, --apply_chat_template, --tokenizer_chat_template; the BOS rule)
    items --> collate.pad_batch [B, L] | collate.pack_batch [1, T]
    ResumableDistributedSampler: which indices each rank reads, resumable mid-epoch
"""

from rlhfkit.data.collate import (PackedBatch, PaddedBatch, pack_batch, pad_batch, pad_sequences,
                                  split_by_token_budget, unpack)
from rlhfkit.data.io import DataError, Row, load_mixture, load_rows, parse_probs
from rlhfkit.data.items import PreferenceItem, PRMItem, SFTItem, UnpairedItem
from rlhfkit.data.preference import (PreferenceDataConfig, PreferenceDataset, UnpairedDataConfig, UnpairedDataset,
                                     kto_mismatched, preference_rows)
from rlhfkit.data.prm import PRMDataConfig, PRMDataset, collate_prm
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset, build_prompt_samples
from rlhfkit.data.sampler import ResumableDistributedSampler
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.data.templates import PromptFormat, check_input_template, render_chat, set_chat_template

__all__ = [
    "DataError", "Row", "load_rows", "load_mixture", "parse_probs",
    "PromptFormat", "check_input_template", "render_chat", "set_chat_template",
    "SFTItem", "PreferenceItem", "UnpairedItem", "PRMItem",
    "SFTDataConfig", "SFTDataset", "PreferenceDataConfig", "PreferenceDataset", "preference_rows",
    "UnpairedDataConfig", "UnpairedDataset", "kto_mismatched", "PRMDataConfig", "PRMDataset", "collate_prm",
    "PromptDataConfig", "PromptDataset", "build_prompt_samples",
    "PaddedBatch", "PackedBatch", "pad_batch", "pack_batch", "pad_sequences", "unpack", "split_by_token_budget",
    "ResumableDistributedSampler",
]
