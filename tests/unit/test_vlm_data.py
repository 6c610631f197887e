"""Vision-language data: pictures read from paths, data URIs, image cells and URLs; placeholders through
`<image>` tags and content parts; errors naming file, row and picture; the drop policy; picture tokens in
prompt lengths and never in the loss (SFT, DPO, RL trajectories)."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import os
import threading

import pytest
import torch
from vlm_helpers import PH, picture

from rlhfkit.data.images import ImageDataConfig, ImageLimits, RowImages, load_vision_processor
from rlhfkit.data.io import DataError, load_rows
from rlhfkit.data.preference import PreferenceDataConfig, PreferenceDataset
from rlhfkit.data.prompts import PromptDataConfig, PromptDataset
from rlhfkit.data.sft import SFTDataConfig, SFTDataset
from rlhfkit.models.vlm import VisionLayout


@pytest.fixture(scope="module")
def kit(tiny_vlm_dir):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vlm_dir)
    layout = VisionLayout.of(AutoConfig.from_pretrained(tiny_vlm_dir))
    return tok, layout, load_vision_processor(tiny_vlm_dir)


def row_images(kit, max_images=2, failure="stop", limits=None):
    tok, layout, proc = kit
    cfg = ImageDataConfig("images", max_images, failure, limits or ImageLimits())
    return RowImages(cfg, proc, PH, layout.image_token_id, layout.special_ids)


def png(path, size=(56, 56), colour=(200, 30, 30)):
    picture(colour, size).save(path)
    return path


def write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prompts(kit, tmp_path, rows, chat=True, **kw):
    tok = kit[0]
    cfg = PromptDataConfig(input_key="prompt", apply_chat_template=chat, max_prompt_len=kw.pop("max_prompt_len", None))
    return PromptDataset(load_rows(write(tmp_path, rows)), tok, cfg, row_images(kit, **kw))


def test_tags_parts_and_sources(kit, tmp_path):
    tok, layout, _ = kit
    (tmp_path / "pics").mkdir()
    png(tmp_path / "pics" / "a.png")
    raw = io.BytesIO()
    picture((30, 40, 220), (60, 28)).save(raw, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(raw.getvalue()).decode()
    rows = [
        {"prompt": "<image>What colour?", "images": ["pics/a.png"]},  # relative to the data file's folder
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and?"},
                                                 {"type": "image"}]}], "images": [uri, uri]},
        {"prompt": "no tag: the picture goes first", "images": str(tmp_path / "pics" / "a.png")},
        {"prompt": "text only"},
    ]
    ds = prompts(kit, tmp_path, rows)
    counts = [s.prompt.count(PH) for s in ds.samples]
    assert counts == [1, 2, 1, 0] and [len(s.images) for s in ds.samples] == [1, 2, 1, 0]
    assert ds.samples[0].prompt.startswith("<|im_start|>user\n" + PH + "What colour?")
    # 56 x 56 -> 2 x 2 merged patches: 4 tokens; 60 x 28 -> 56 x 28: 2 tokens
    assert [r.num_tokens for r in ds.samples[1].images] == [2, 2] and ds.samples[0].images[0].num_tokens == 4
    n_text = len(tok(ds.samples[0].prompt, add_special_tokens=False)["input_ids"])
    assert ds.lengths[0] == n_text + 3  # the placeholder's one token became 4
    plain = prompts(kit, tmp_path, rows[:1], chat=False)
    assert plain.samples[0].prompt == PH + "What colour?"
    from rlhfkit.data.io import RowSource  # rows in memory: a datasets Image cell ({"bytes": ...}) and a PIL image

    cells = [{"prompt": "<image><image>?", "images": [{"bytes": raw.getvalue(), "path": None}, picture((1, 2, 3),
                                                                                                      (28, 28))]}]
    mem = PromptDataset(load_rows(RowSource(cells)), tok, PromptDataConfig(input_key="prompt", apply_chat_template=True),
                        row_images(kit))
    assert [r.num_tokens for r in mem.samples[0].images] == [2, 1]


def test_url_pictures_download_once(kit, tmp_path):
    png(tmp_path / "u.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/u.png"
        ds = prompts(kit, tmp_path, [{"prompt": "<image>?", "images": [url]}])
    finally:
        server.shutdown()
    assert isinstance(ds.samples[0].images[0].source, bytes)  # kept: the rollout reads no URL again


@pytest.mark.parametrize("rows, expect", [
    ([{"prompt": "<image>?", "images": ["missing.png"]}], "data.jsonl row 1 image 1: cannot read image 'missing.png': no such file"),
    ([{"prompt": "ok", "images": []}, {"prompt": "<image><image><image>", "images": ["a.png"] * 3}],
     "data.jsonl row 2: 3 pictures in 'images' (--image_key), more than --max_images_per_prompt 2"),
    ([{"prompt": "<image><image>?", "images": ["a.png"]}], "row 1: key 'prompt' has 2 picture placeholder(s)"),
    ([{"prompt": "<image>?", "images": ["not_a_picture.txt"]}], "row 1 image 1: cannot read image 'not_a_picture.txt'"),
])
def test_bad_pictures_name_file_and_row(kit, tmp_path, rows, expect):
    png(tmp_path / "a.png")
    (tmp_path / "not_a_picture.txt").write_text("hello")
    with pytest.raises(DataError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        prompts(kit, tmp_path, rows)


def test_limits_and_the_drop_policy(kit, tmp_path):
    png(tmp_path / "a.png")
    png(tmp_path / "big.png", size=(200, 100))
    rows = [{"prompt": "<image>?", "images": ["a.png"]}, {"prompt": "<image>?", "images": ["missing.png"]},
            {"prompt": "<image>?", "images": ["big.png"]}]
    with pytest.raises(DataError, match="data.jsonl row 2 image 1: cannot read image 'big.png': 200 x 100 pixels, over "
                                        "--max_image_pixels 10000"):
        prompts(kit, tmp_path, [rows[0], rows[2]], limits=ImageLimits(max_pixels=10_000))
    with pytest.raises(DataError, match="over --max_image_bytes 10"):
        prompts(kit, tmp_path, rows[:1], limits=ImageLimits(max_bytes=10))
    ds = prompts(kit, tmp_path, rows, failure="drop", limits=ImageLimits(max_pixels=10_000))
    assert len(ds.samples) == 1 and ds.num_bad_images == 2 and ds.num_dropped == 2


def test_prompt_length_counts_picture_tokens(kit, tmp_path):
    png(tmp_path / "a.png", size=(112, 112))  # 4 x 4 merged patches: 16 tokens
    rows = [{"prompt": "<image>?", "images": ["a.png"]}, {"prompt": "?"}]
    text_len = len(kit[0](prompts(kit, tmp_path, rows[1:]).samples[0].prompt, add_special_tokens=False)["input_ids"])
    ds = prompts(kit, tmp_path, rows, max_prompt_len=text_len + 10)  # room for the 3 marker tokens, not 16 pictures'
    assert len(ds.samples) == 1 and not ds.samples[0].images


def test_sft_and_dpo_items_keep_picture_tokens_out_of_the_loss(kit, tmp_path):
    tok, layout, _ = kit
    png(tmp_path / "a.png")
    rows = [{"prompt": "<image>What colour?", "images": ["a.png"], "output": "red", "chosen": "red",
             "rejected": "blue"}]
    sft = SFTDataset(load_rows(write(tmp_path, rows)), tok,
                     SFTDataConfig(input_key="prompt", output_key="output", apply_chat_template=True, max_len=64),
                     row_images(kit))
    item = sft.items[0]
    pad = layout.image_token_id
    assert item.input_ids.count(pad) == 4 and len(item.images) == 1
    assert all(m == 0 for t, m in zip(item.input_ids, item.loss_mask) if t in layout.special_ids)
    assert tok.decode([t for t, m in zip(item.input_ids, item.loss_mask) if m]) == "red<|im_end|></s>"
    cut = SFTDataset(load_rows(write(tmp_path, rows)), tok,
                     SFTDataConfig(input_key="prompt", output_key="output", apply_chat_template=True, max_len=8),
                     row_images(kit))
    assert not cut.items and cut.num_dropped == 1  # max_len would cut into the picture's run: dropped
    dpo = PreferenceDataset(load_rows(write(tmp_path, rows)), tok,
                            PreferenceDataConfig(prompt_key="prompt", apply_chat_template=True, max_len=64),
                            row_images(kit))
    pair = dpo.items[0]
    assert pair.chosen_ids.count(pad) == pair.rejected_ids.count(pad) == 4 and len(pair.images) == 1
    from rlhfkit.data.preference import preference_rows

    assert [len(r.images) for r in preference_rows([pair])] == [1, 1]


def test_trajectories_keep_vision_tokens_out_of_the_loss():
    from rlhfkit.algo.experience import pad_trajectories
    from rlhfkit.types import Trajectory

    # a (hypothetical) action token 9 that is a vision marker, and a plain action token 5
    tr = Trajectory(token_ids=[1, 7, 7, 2, 9, 5], action_mask=[0, 0, 0, 0, 1, 1], rollout_logprobs=[0.0] * 6,
                    prompt_len=4)
    batch = pad_trajectories([tr], pad_id=0, no_loss_ids=(7, 9))
    assert batch.loss_mask.tolist() == [[0, 0, 0, 0, 0, 1]] and batch.images is None
    assert pad_trajectories([tr], pad_id=0).loss_mask.tolist() == [[0, 0, 0, 0, 1, 1]]


def test_expand_and_runs_reject_mismatches(kit):
    from rlhfkit.models.vlm import VisionModelError, expand_placeholders, placeholder_runs

    tok, layout, proc = kit
    pics = proc.process([picture((1, 2, 3), (56, 28)), picture((1, 2, 3), (28, 28))])
    pad = layout.image_token_id
    ids = expand_placeholders([5, pad, 6, pad, 7], pics, layout)
    assert ids == [5, pad, pad, 6, pad, 7]
    assert placeholder_runs(ids, pics, layout) == [(1, 2), (4, 1)]
    with pytest.raises(VisionModelError, match="1 image placeholder"):
        expand_placeholders([5, pad], pics, layout)
    with pytest.raises(VisionModelError, match="generated placeholder token"):
        placeholder_runs(ids + [pad], pics, layout)
    assert torch.equal(pics.picture(1).grid_thw, pics.grid_thw[1:])
