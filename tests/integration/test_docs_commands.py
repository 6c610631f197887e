"""The README's and docs/*.md's commands and Python examples run as written, on the tiny model, in a temp folder.

Every ```bash block of README.md and docs/*.md is extracted and run with `bash -euo pipefail`, and
every ```python block with this venv's python, with this venv's bin/ first on PATH (as after
`make demo` with the venv activated):

- the README's block marked `<!-- docs-test: setup -->` (tiny model, `rlhfkit make_data`) runs once
  into a fresh folder; each page then runs in its own copy of that folder, so a page may use
  ./tiny, data/ and examples/ as the README's set-up leaves them;
- a page's blocks run in order in the same folder, so a block may use what an earlier one wrote;
- a block marked `<!-- docs-test: skip (reason) -->` (on the line before the fence, blank lines
  allowed) is not run (it needs GPUs, a cluster, or a network); each one is reported as a skipped
  test with its reason, and still has to parse (`bash -n`, or Python's compiler);
- a block marked `<!-- docs-test: model (HUB_ID) -->` names a hub model: it runs in its page's run with
  HUB_ID replaced by the set-up's ./tiny. What the commands do on a real pretrained model (the chat
  template, SFT, DPO, GRPO, the export read by transformers) is tested on SmolLM2-135M-Instruct by
  tests/integration/test_real_model.py; the same commands on it here would check those things again
  at ten times the cost.

The README itself is a user's page: at most README_MAX_LINES lines, and its first commands are the
two that set up a fresh machine (`make demo`, `make test`).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, subprocess_env

MARK = re.compile(r"^<!--\s*docs-test:\s*(skip|setup|model)\s*(?:\((.*)\))?\s*-->$")
FENCE = re.compile(r"^```(bash|sh|shell|python)\s*$")
BLOCK_TIMEOUT = 600
README_MAX_LINES = 200


@dataclasses.dataclass
class Block:
    page: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    kind: str  # run | skip | setup | model (reason: the hub id to replace)
    reason: str
    text: str
    lang: str = "bash"  # bash | python

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def extract(text: str, page: str) -> list[Block]:
    """The shell blocks of a markdown text with their docs-test marks."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i].strip())
        if not fence:
            if lines[i].strip().startswith("```"):  # another language's block: skip over it whole
                j = i + 1
                while j < len(lines) and lines[j].strip() != "```":
                    j += 1
                i = j + 1
                continue
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = MARK.match(lines[j].strip()) if j >= 0 else None
        kind, reason = (m.group(1), (m.group(2) or "").strip()) if m else ("run", "")
        if kind in ("skip", "model") and not reason:
            raise ValueError(f"{page}:{i + 1}: a docs-test {kind} needs its (reason / hub id): "
                             f"<!-- docs-test: {kind} (...) -->")
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: unclosed code block")
        lang = "python" if fence.group(1) == "python" else "bash"
        out.append(Block(page, i + 1, kind, reason, "\n".join(lines[i + 1:end]) + "\n", lang))
        i = end + 1
    return out


def pages() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def blocks_of(page: str) -> list[Block]:
    with open(os.path.join(ROOT, page)) as f:
        return extract(f.read(), page)


ALL_BLOCKS = [b for p in pages() for b in blocks_of(p)]


def env() -> dict[str, str]:
    e = subprocess_env(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
                       RAY_USAGE_STATS_ENABLED="0")
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    e.pop("RAY_ADDRESS", None)
    return e


def run_block(block: Block, cwd: str) -> None:
    """Run `block` in `cwd`; a `model` block with its hub id replaced by the set-up's ./tiny."""
    script = os.path.join(cwd, f".docs_block_{block.line}.{'py' if block.lang == 'python' else 'sh'}")
    with open(script, "w") as f:
        f.write(block.text.replace(block.reason, "./tiny") if block.kind == "model" else block.text)
    cmd = [sys.executable, script] if block.lang == "python" else ["bash", "-euo", "pipefail", script]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT} s:\n{block.text}\n{e.stdout or ''}")
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"{block.where}: exit {proc.returncode}\n--- block ---\n{block.text}--- output (tail) ---\n{out}")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> str:
    """A folder after the README's set-up block."""
    setup = [b for b in ALL_BLOCKS if b.kind == "setup"]
    assert len(setup) == 1 and setup[0].page == "README.md", [b.where for b in setup]
    d = str(tmp_path_factory.mktemp("docs_setup"))
    run_block(setup[0], d)
    return d


@pytest.mark.slow
@pytest.mark.xdist_group("docs_pages")  # with `--dist loadgroup` (make test) one worker runs every page: one set-up
@pytest.mark.parametrize("page", [p for p in pages() if any(b.kind == "run" for b in blocks_of(p))])
def test_page_commands_run(page, prepared, tmp_path):
    work = str(tmp_path / "work")
    shutil.copytree(prepared, work, symlinks=True)
    for block in blocks_of(page):
        if block.kind in ("run", "model"):
            run_block(block, work)


@pytest.mark.parametrize("where", [b.where for b in ALL_BLOCKS if b.kind == "skip"])
def test_block_not_run_here(where):
    block = next(b for b in ALL_BLOCKS if b.where == where)
    pytest.skip(f"{where}: {block.reason}")


def test_every_block_parses(tmp_path):
    bad = []
    for b in ALL_BLOCKS:
        if b.lang == "python":
            try:
                compile(b.text, b.where, "exec")
            except SyntaxError as e:
                bad.append(f"{b.where}: {e}")
            continue
        proc = subprocess.run(["bash", "-n"], input=b.text, capture_output=True, text=True)
        if proc.returncode:
            bad.append(f"{b.where}: {proc.stderr.strip()}")
    assert not bad, "\n".join(bad)


def test_readme_is_a_users_page():
    """At most README_MAX_LINES lines; its first commands set up a fresh machine; a command line and a
    Python example that are really run (not skipped)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        n = len(f.read().splitlines())
    assert n <= README_MAX_LINES, n
    blocks = blocks_of("README.md")
    assert blocks[0].text.split()[:2] == ["make", "demo"] and "\nmake test" in blocks[0].text, blocks[0].text
    assert any(b.kind == "run" and b.lang == "bash" for b in blocks)
    assert any(b.kind == "run" and b.lang == "python" for b in blocks)


def test_extract_reads_marks_and_order():
    text = ("# t\n```bash\necho one\n```\n<!-- docs-test: skip (needs 8 GPUs) -->\n\n```bash\ntorchrun x\n```\n"
            "```python\nprint(1)\n```\n```yaml\na: 1\n```\n<!-- docs-test: setup -->\n```sh\nmkdir d\n```\n"
            "<!-- docs-test: model (org/m) -->\n```bash\nls org/m\n```\n")
    got = [(b.line, b.kind, b.reason, b.text, b.lang) for b in extract(text, "t.md")]
    assert got == [(2, "run", "", "echo one\n", "bash"), (7, "skip", "needs 8 GPUs", "torchrun x\n", "bash"),
                   (10, "run", "", "print(1)\n", "python"), (17, "setup", "", "mkdir d\n", "bash"),
                   (21, "model", "org/m", "ls org/m\n", "bash")]
    with pytest.raises(ValueError, match="t.md:2: a docs-test skip needs its"):
        extract("<!-- docs-test: skip -->\n```bash\nx\n```\n", "t.md")


WORKFLOW_PAGES = ("sft", "rm", "dpo", "kto", "prm", "kd", "rl", "agents", "ray", "lora", "batch_inference",
                  "coming_from")


def test_every_workflow_page_has_a_command_that_runs():
    """Each workflow page exists and shows a command that is really run (not only skipped ones)."""
    without = [p for p in WORKFLOW_PAGES if not os.path.isfile(os.path.join(ROOT, "docs", p + ".md"))
               or not any(b.kind == "run" for b in blocks_of(f"docs/{p}.md"))]
    assert not without, without


def test_relative_links_resolve():
    """Links like [sft](docs/sft.md) or [flags](flags/train_sft.md#x) point at files that exist."""
    missing = []
    for page in pages():
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                missing.append(f"{page}: {target}")
    assert not missing, missing
