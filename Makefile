# `make demo` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
EXTRAS ?= dev,serve,ray
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean bench-cpu

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch: keep an importable one; otherwise install the pinned CPU wheel.
# Bytecode is compiled once on every core (compileall -j 0) rather than file by file by pip; a file
# written for a newer Python (torch ships one) does not compile, as under pip, and is skipped.
# Left to compile when first imported: packages' own tests, the installers, the model families of
# transformers and the Ray libraries that rlhfkit does not use, and openai's type stubs (half the files).
NO_PRECOMPILE := /(tests?|pip|setuptools|virtualenv|fontTools)/|/transformers/models/(?!(auto|llama|qwen|mistral|mixtral))|/ray/(rllib|tune|train|data|serve|llm|air|workflow)/|/openai/types/
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q --no-compile torch==2.13.0
	$(VPY) -m pip install -q --no-compile -e ".[$(EXTRAS)]"
	$(VPY) -m compileall -q -j 0 -x '$(NO_PRECOMPILE)' $$($(VPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlhfkit quickstart

# --dist loadgroup: tests marked xdist_group(name) run on one worker (they share a session fixture).
# -n 3 on two cores: a third worker runs while the others wait on a Ray, a server or a subprocess.
# Bytecode caches on (whatever PYTHONDONTWRITEBYTECODE says): every worker and every server of
# tests/warmstart imports rlhfkit and the test modules, which otherwise compile again each time.
# TMPDIR in memory (/dev/shm where there is one, removed afterwards): the tests save hundreds of small
# checkpoints, each file fsynced as a real run does, and on a disk those flushes stall every process.
test: $(STAMP)
	d=$$(mktemp -d /dev/shm/rk-XXXXXX 2>/dev/null || mktemp -d); \
	TMPDIR=$$d env -u PYTHONDONTWRITEBYTECODE $(VPY) -m pytest -q -n 3 --dist loadgroup --durations=15 tests; \
	rc=$$?; rm -rf $$d; exit $$rc

bench-cpu: $(STAMP)
	$(VPY) bench/train_throughput.py --device cpu

clean:
	rm -rf $(VENV) runs
