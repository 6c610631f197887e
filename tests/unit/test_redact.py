"""rlhfkit.redact: the secret rules, word by word."""

from __future__ import annotations

import json

from rlhfkit.redact import redact_argv, redact_config, redact_text


def test_wandb_key_in_both_spellings_and_forms():
    argv = ["--pretrain", "m", "--use_wandb", "k3y-abc", "--logger.wandb.key=k3y-def", "--lr", "1"]
    assert redact_argv(argv) == ["--pretrain", "m", "--use_wandb", "***", "--logger.wandb.key=***", "--lr", "1"]
    assert redact_argv(["--use_wandb", "True", "--x"]) == ["--use_wandb", "True", "--x"]  # no key: kept
    assert redact_argv(["--use_wandb", "--x"]) == ["--use_wandb", "--x"]


def test_url_credentials_and_secret_query_values():
    assert redact_text("http://bob:pa55@rm.example:5000/get_reward") == "http://bob:***@rm.example:5000/get_reward"
    assert redact_text("https://tok123@h/r") == "https://***@h/r"
    assert redact_text("http://h/r?model=a&token=xyz&api_key=q") == "http://h/r?model=a&token=***&api_key=***"
    assert redact_text("http://h:5000/get_reward") == "http://h:5000/get_reward"  # nothing secret: untouched
    both = "http://a/x?access_token=1,http://b/y?sig=2"
    assert redact_text(both) == "http://a/x?access_token=***,http://b/y?sig=***"


def test_token_shapes_and_environment_values(monkeypatch):
    assert redact_text("use hf_" + "a" * 34 + " now") == "use *** now"
    monkeypatch.setenv("MY_SERVICE_TOKEN", "s3cr3t-value")
    monkeypatch.setenv("SHORT_TOKEN", "1")  # too short to be searched for
    assert redact_text("header=s3cr3t-value;n=1") == "header=***;n=1"


def test_config_values():
    cfg = {"use_wandb": "k3y", "remote_rm_url": "http://u:p@h/r", "target_modules": ["q", "http://x/?token=t"],
           "lr": 1e-3, "off": None}
    out = redact_config(cfg)
    assert out == {"use_wandb": True, "remote_rm_url": "http://u:***@h/r", "target_modules": ["q", "http://x/?token=***"],
                   "lr": 1e-3, "off": None}
    assert "k3y" not in json.dumps(out)
    assert redact_config({"use_wandb": None})["use_wandb"] is False
