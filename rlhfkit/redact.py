"""Secrets kept out of everything a run writes or prints (a leaf module, like fileio.py).

One rule set, used by the model card's command line, run_config.json, the wandb config, the run
directory's lock file and the resume command printed when a run is stopped:

    redact_argv(argv)          a command line: the value of --use_wandb / --logger.wandb.key (an API
                               key; True/False stay), then `redact_text` on every word
    redact_text(s)             in any string: the password of a URL (`http://user:***@host`), the
                               value of a URL query parameter whose name says secret (`?token=***`,
                               api_key, access_token, password, secret, signature, ...), Hugging
                               Face / OpenAI style tokens (hf_..., sk-...) and the value of every
                               environment variable whose name says secret (WANDB_API_KEY,
                               HF_TOKEN, *_TOKEN, *_API_KEY, *_SECRET*, *PASSWORD*) wherever it appears
    redact_config(d)           flag values by dest: `use_wandb` becomes a bool, strings go through
                               `redact_text` (lists too)

A redacted value is replaced by `***`; a command line shown with one is not runnable as it stands:
give the secret again (or `--use_wandb True` once wandb is logged in).
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

MASK = "***"
SECRET_FLAGS = ("--use_wandb", "--logger.wandb.key")  # flags whose value is a key
SECRET_DESTS = ("use_wandb",)
NOT_A_KEY = ("", "True", "true", "1", "False", "false", "0", "None")
_SECRET_NAME = re.compile(r"(token|api[_-]?key|apikey|secret|passw(or)?d|access[_-]?key|auth|sig(nature)?|"
                          r"credential|private[_-]?key|session)", re.IGNORECASE)
_ENV_NAME = re.compile(r"(TOKEN|API_?KEY|SECRET|PASSW(OR)?D|ACCESS_?KEY|CREDENTIAL|PRIVATE_?KEY)", re.IGNORECASE)
_TOKEN_SHAPES = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{20,})\b")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\",<>]+")  # a comma ends one (--remote_rm_url a,b)
MIN_ENV_SECRET = 6  # shorter environment values ("1", "true") are no secrets worth a search


def env_secrets() -> list[str]:
    """Values of this process's environment variables whose names say secret, longest first."""
    vals = {v for k, v in os.environ.items() if _ENV_NAME.search(k) and len(v) >= MIN_ENV_SECRET}
    return sorted(vals, key=len, reverse=True)


def _redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{MASK}@{host}" if ":" in userinfo else f"{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_NAME.search(k) for k, _ in pairs):
            query = "&".join(f"{k}={MASK}" if _SECRET_NAME.search(k) else (f"{k}={v}" if v else k)
                             for k, v in pairs)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """`text` with URL credentials, secret query values, token-shaped words and secret environment
    values replaced by `***`."""
    if not text:
        return text
    out = _URL.sub(lambda m: _redact_url(m.group(0)), text)
    out = _TOKEN_SHAPES.sub(MASK, out)
    for value in env_secrets():
        out = out.replace(value, MASK)
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """A command line with the keys of SECRET_FLAGS and every `redact_text` secret replaced."""
    out: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            hide_next = False
            if not word.startswith("--"):
                out.append(word if word in NOT_A_KEY else MASK)
                continue
        name, eq, value = word.partition("=")
        if name in SECRET_FLAGS:
            if eq:
                out.append(word if value in NOT_A_KEY else f"{name}={MASK}")
                continue
            hide_next = True
        out.append(redact_text(word))
    return out


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(v) for v in value)
    if isinstance(value, dict):
        return {k: _redact_value(v) for k, v in value.items()}
    return value


def redact_config(config: dict[str, Any]) -> dict[str, Any]:
    """Flag values (dest -> value) fit to write down: SECRET_DESTS as bools, strings redacted."""
    out = {}
    for k, v in config.items():
        if k in SECRET_DESTS:
            out[k] = bool(v) and str(v) not in ("False", "false", "0")
        else:
            out[k] = _redact_value(v)
    return out
