"""The tokenizer saved with a reward (or critic) model, so that plain transformers scores text as rlhfkit
trained on it.

rlhfkit scores a row as (rlhfkit.data.items)

    encode(prompt, start=True) + encode(response without trailing newlines) + [eos unless it ends so]

where `start=True` is the BOS rule of rlhfkit.data.templates (the BOS the tokenizer adds, once). The
reward is the value at the last token. `scoring_tokenizer` makes a copy of the training tokenizer whose
plain call, `tokenizer(text)` (special tokens on, as `pipeline("text-classification")` and
`AutoTokenizer(...)(texts)` call it), gives those ids for the text the docs tell users to pass:

* rows of plain text (no `--apply_chat_template`): the prompt text followed by the response text. The
  post-processor becomes `[bos] $A <eos>`: the BOS only where the base tokenizer adds one.
* rows rendered by the chat template (`chat=True`): `tokenizer.apply_chat_template(messages,
  tokenize=False)` with the saved tokenizer, messages ending with the assistant's answer. The chat
  template is the base's wrapped (`scoring_chat_template`) so that such a conversation renders as
  training saw it: trailing newlines stripped (ChatML's `<|im_end|>\\n` ends at `<|im_end|>`), EOS
  appended unless the text ends with it (Gemma: `<end_of_turn><eos>`; with SmolLM2 the EOS is
  `<|im_end|>`, so nothing is appended and no second `<|im_end|>` appears). Prompts rendered with
  `add_generation_prompt=True` and other conversations render as before. The post-processor appends
  nothing and adds the base's BOS only when the template does not write one (Gemma's writes `<bos>`).

The result is checked on a probe row against the training ids (`check_scoring`); a tokenizer that cannot
be made to match (a slow tokenizer, a template the wrapper changes) is saved as it is, with one line
saying so. Its pad token is never EOS (the base's BOS or another special token pads instead), so the
rightmost non-pad token that `*ForSequenceClassification` scores is the last real one.
"""

from __future__ import annotations

import copy
from typing import Any

from rlhfkit.config.notes import note_once

SCORING_MARK = "{#- rlhfkit: the reward model's scoring form (rlhfkit.models.scoring_tokenizer) -#}"
_PROBE_PROMPT = [{"role": "user", "content": "What is 1+1?"}]
_PROBE_ANSWER = [{"role": "assistant", "content": "It is 2."}]


def scoring_chat_template(template: str) -> str:
    """`template` wrapped: a conversation ending with an assistant message renders without trailing
    newlines and with `eos_token` at the end (once); anything else renders as `template` does.
    Idempotent (a wrapped template carries `SCORING_MARK`)."""
    if template.startswith(SCORING_MARK):
        return template
    return (SCORING_MARK + "{% set rlhfkit_rendered %}" + template + "{% endset %}"
            "{% if not add_generation_prompt and messages and messages[-1]['role'] == 'assistant' %}"
            "{% set rlhfkit_text = rlhfkit_rendered.rstrip('\\n') %}"
            "{{ rlhfkit_text if (not eos_token or rlhfkit_text.endswith(eos_token)) else rlhfkit_text + eos_token }}"
            "{% else %}{{ rlhfkit_rendered }}{% endif %}")


def is_scoring_template(template: str | None) -> bool:
    return bool(template) and template.startswith(SCORING_MARK)


def appends_eos(tokenizer: Any) -> bool:
    """`tokenizer(text)` (special tokens on, as plain transformers calls it) ends with EOS after the text's ids."""
    probe = "1 a"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(probe)["input_ids"])
    return ids[-len(plain) - 1:] == plain + [tokenizer.eos_token_id]


def training_ids(tokenizer: Any, prompt: str, response: str) -> list[int]:
    """The ids rlhfkit trains and scores for (prompt, response) texts (no length limit)."""
    from rlhfkit.data.items import encode_prompt_response, join_prompt_response

    p_ids, r_ids = encode_prompt_response(tokenizer, prompt, response)
    joined = join_prompt_response(p_ids, r_ids, tokenizer.eos_token_id, len(p_ids) + len(r_ids) + 1)
    assert joined is not None
    return joined[0]


def check_scoring(saved: Any, base: Any, chat: bool) -> None:
    """Raise ValueError unless `saved(text)` gives the training ids of a probe row (`base`: the training
    tokenizer; `chat`: rows rendered by the chat template)."""
    from rlhfkit.data.templates import render_chat

    if chat:
        head = render_chat(base, _PROBE_PROMPT, add_generation_prompt=True)
        full = render_chat(base, _PROBE_PROMPT + _PROBE_ANSWER)
        if not full.startswith(head):
            raise ValueError("the chat template does not render the answer after the generation prompt")
        want, text = training_ids(base, head, full[len(head):]), render_chat(saved, _PROBE_PROMPT + _PROBE_ANSWER)
    else:
        want, text = training_ids(base, "Question: 1+1?\n", "Answer: 2"), "Question: 1+1?\nAnswer: 2"
    got = list(saved(text)["input_ids"])
    if got != want:
        raise ValueError(f"it gives {got} for a probe row trained as {want}")


def _pad_other_than_eos(tokenizer: Any) -> str | None:
    """A special token that is not EOS, to pad with (BOS first)."""
    eos = tokenizer.eos_token_id
    names = [tokenizer.bos_token, tokenizer.unk_token, *getattr(tokenizer, "all_special_tokens", [])]
    return next((t for t in names if t is not None and tokenizer.convert_tokens_to_ids(t) != eos), None)


def scoring_tokenizer(tokenizer: Any, chat: bool | None = None) -> Any:
    """A copy of `tokenizer` to save with a reward/critic model (module docstring). `chat`: the model was
    trained on rows rendered by the chat template (None: as the tokenizer's template says, so that a
    saved scoring tokenizer passed again stays as it is). The tokenizer itself is returned, and one line
    printed, when the copy cannot be made to score as training did."""
    if tokenizer is None:
        return None
    from rlhfkit.data.templates import added_bos, has_chat_template, render_chat

    chat = is_scoring_template(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    try:
        if tokenizer.eos_token_id is None:
            raise ValueError("it has no EOS token")
        if chat and not has_chat_template(tokenizer):
            raise ValueError("it has no chat template")
        tok = copy.deepcopy(tokenizer)
        add_bos = added_bos(tokenizer) is not None
        if chat:
            tok.chat_template = scoring_chat_template(tokenizer.chat_template)
            add_bos = add_bos and not render_chat(tok, _PROBE_PROMPT).startswith(tok.bos_token)
        tok.add_bos_token = add_bos  # fast tokenizers: the post-processor becomes `[bos] $A [eos]`
        tok.add_eos_token = not chat
        check_scoring(tok, tokenizer, chat)
    except (AttributeError, ValueError, TypeError) as e:
        form = "apply_chat_template text" if chat else "prompt + response text"
        note_once(f"note: the saved tokenizer does not score {form} in plain transformers as training did ({e}); "
                  "rlhfkit's own scoring is unaffected")
        return tokenizer
    tok.init_kwargs.update(add_bos_token=add_bos, add_eos_token=not chat)  # read back by from_pretrained
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        pad = _pad_other_than_eos(tok)
        if pad is not None:
            tok.pad_token = pad
    return tok
