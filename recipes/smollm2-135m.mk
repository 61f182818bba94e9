# The recipes behind the committed SmolLM2-135M heads and every arm in docs/results-log.md, oldest first.
# Included by the Makefile (VENV and PY come from there); run them from the repository root, e.g.
# make finetune-smollm2-s29 S29_GAMMA=1. Each stage resumes where it stopped; data/ and runs/ are git-ignored.
# The committed head's own lineage: README "Training" and heads/smollm2-135m-dflash2/training_recipe.json.

.PHONY: store-smollm2 train-smollm2 finetune-smollm2 finetune-smollm2-6000 finetune-smollm2-code finetune-smollm2-code2 finetune-smollm2-s10 finetune-smollm2-s13 finetune-smollm2-s14 finetune-smollm2-s15 finetune-smollm2-s16 store-smollm2-s16-long finetune-smollm2-s17 ablation-smollm2 ablation-smollm2-s14 ablation-smollm2-s17 regenerate-smollm2 regenerate-smollm2-s20 store-smollm2-s21 grow-smollm2-s21 finetune-smollm2-s22 finetune-smollm2-s23 store-smollm2-s24 finetune-smollm2-s24 soup-smollm2-s25 regenerate-smollm2-s26 store-smollm2-s26 finetune-smollm2-s26 grow-smollm2-s26 store-smollm2-s28 finetune-smollm2-s28 control-smollm2-s28 finetune-smollm2-s29 regenerate-smollm2-s33 store-smollm2-s33 finetune-smollm2-s33 regenerate-smollm2-s34 store-smollm2-s34 finetune-smollm2-s34 arm-smollm2-s34 store-smollm2-s35 arm-smollm2-s35 soup-smollm2-s35 arm-smollm2-s38 regenerate-smollm2-s38 store-smollm2-s38 arm-smollm2-s39 long-smollm2-s40 cool-smollm2-s40 ablation-smollm2-s42 cool-copy-smollm2-s42

# The committed SmolLM2-135M heads. (1) The feature/label store: the target runs once over ShareGPT's
# own first exchanges (MT-Bench / HumanEval prompts removed), keeping its tapped layers and top-32
# log-probabilities. (2) The flagship dFlash 2 head, KL to the target's top-32. (3) The recipe arms,
# DFlash-1 at the base arm's budget among them. (4) Export. Every stage resumes where it stopped.
STORE := data/store_sharegpt
# This round's recipe (README "Training"): B = 8, 2 x 64 anchors per step, output norm at 0.1 of the target's,
# no logit ramp, draft vocabulary 8192 (97 % of the target's argmax labels). Stops after 85 minutes with a
# checkpoint; the same command resumes it.
FLAGSHIP_ARGS := --store $(STORE) --steps 7000 --warmup-steps 100 --batch-size 2 --anchors 64 --lr 1e-3 \
	--label-source kl --layers 2 --block-size 8 --selector-rank 128 --draft-vocab-size 8192 --mask-token-id 0 \
	--output-scale 0.1 --logit-ramp-steps 0 --eval-every 1000 --eval-prompts 8 --eval-max-new-tokens 64 \
	--checkpoint-every 100 --log-every 50 --stop-after-minutes 85 --resume

store-smollm2: setup
	$(VENV)/bin/hf-dflash2 store --output $(STORE) --max-tokens 1000000 --target-layer-ids 1,7,14,20,27

train-smollm2: store-smollm2
	$(VENV)/bin/hf-dflash2 train $(FLAGSHIP_ARGS) --output runs/flagship2
	$(PY) benchmarks/recipe_arms.py --store $(STORE) --sequences 1000 --steps 60 --parallel 1
	$(PY) benchmarks/tau_curve.py runs/flagship2
	# A run's head replaces heads/smollm2-135m-dflash2 only when it beats it on held-out tau:
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/flagship2/head --prompts 8 --tokens 64
	$(PY) -m hf_dflash2.training.export runs/flagship2 runs/flagship2/export \
		--data-description "ShareGPT first exchanges run through SmolLM2-135M-Instruct (feature store, KL to its top-32)"

# The committed head: the flagship's weights fine-tuned on the target's own greedy responses (matched data).
REGEN := data/regen_sharegpt.jsonl
FT_PROMPTS ?= 1500
FT_STORE ?= data/store_regen
FT_STORE_TOKENS ?= 600000
FT_FROM ?= runs/flagship2
FT_RUN ?= runs/finetune_regen
FT_STEPS ?= 1000

finetune-smollm2: setup
	$(VENV)/bin/hf-dflash2 regenerate --output $(REGEN) --limit $(FT_PROMPTS) --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 store --output $(FT_STORE) --source $(REGEN) --target-layer-ids 1,7,14,20,27 \
		--max-tokens $(FT_STORE_TOKENS)
	$(VENV)/bin/hf-dflash2 train --store $(FT_STORE) --init-from $(FT_FROM) --output $(FT_RUN) \
		--steps $(FT_STEPS) --warmup-steps 30 --batch-size 2 --anchors 64 --lr 3e-4 --label-source kl --layers 2 \
		--block-size 8 --selector-rank 128 --draft-vocab-size 8192 --mask-token-id 0 --output-scale 0.1 \
		--logit-ramp-steps 0 --eval-every 500 --eval-prompts 8 --eval-max-new-tokens 64 --checkpoint-every 100 \
		--log-every 50 --resume
	$(PY) -m hf_dflash2.training.export $(FT_RUN) $(FT_RUN)/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 $(FT_RUN)/export --prompts 16 --tokens 64

# The next fine-tune (session 5's plan): 6,000 regenerated prompts (4x), about one epoch, from the committed
# head's run. Resumable at every stage; compare on held-out tau before replacing the committed head.
finetune-smollm2-6000:
	$(MAKE) finetune-smollm2 FT_PROMPTS=6000 FT_STORE=data/store_regen6000 FT_STORE_TOKENS=1500000 \
		FT_FROM=runs/finetune_regen FT_RUN=runs/finetune_regen6000 FT_STEPS=3000

# Session 8: the data moves towards what is evaluated. The ShareGPT prompts past the first 6,000, and 3,000
# HumanEval-shaped completions of documented functions of the standard library and installed packages
# (`--prompts python-functions`; HumanEval itself is never read), in a store of their own; then a fine-tune
# of the committed head's run on it (its general data was seen in that run already). Resumable at every
# stage; compared on held-out tau before it replaces the committed head.
CODE_REGEN := data/regen_code.jsonl
finetune-smollm2-code: setup
	$(VENV)/bin/hf-dflash2 regenerate --output $(REGEN) --limit 12000 --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 regenerate --prompts python-functions --output $(CODE_REGEN) --limit 3000 --batch-size 64 \
		--max-new-tokens 192
	tail -n +6001 $(REGEN) > data/regen_sharegpt_after6000.jsonl
	$(VENV)/bin/hf-dflash2 store --output data/store_code --source data/regen_sharegpt_after6000.jsonl,$(CODE_REGEN) \
		--target-layer-ids 1,7,14,20,27 --max-tokens 4000000
	$(VENV)/bin/hf-dflash2 train --store data/store_code --init-from runs/finetune_regen6000 \
		--output runs/finetune_code --steps 2000 --warmup-steps 30 --batch-size 2 --anchors 64 --lr 3e-4 \
		--label-source kl --layers 2 --block-size 8 --selector-rank 128 --draft-vocab-size 8192 --mask-token-id 0 \
		--output-scale 0.1 --logit-ramp-steps 0 --eval-every 500 --eval-prompts 8 --eval-max-new-tokens 64 \
		--checkpoint-every 100 --log-every 50 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_code runs/finetune_code/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_code/export --prompts 16 --tokens 64

# Session 9's experiment (not adopted: held-out tau all +0.002, HumanEval +0.055, MT-Bench -0.031): 1,024 more
# python-functions completions (past the 3,000 session 8 used, --skip), ShareGPT text as replay (120k tokens),
# 1,200 steps from the committed head itself (--init-from a saved head). Resumable at every stage.
finetune-smollm2-code2: setup
	$(VENV)/bin/hf-dflash2 regenerate --prompts python-functions --skip 3000 --output data/regen_code_s9.jsonl \
		--limit 1024 --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 store --output data/store_s9 --source data/regen_code_s9.jsonl,sharegpt \
		--target-layer-ids 1,7,14,20,27 --max-tokens 434765
	$(VENV)/bin/hf-dflash2 train --store data/store_s9 --init-from heads/smollm2-135m-dflash2 \
		--output runs/finetune_s9 --steps 1200 --warmup-steps 30 --batch-size 2 --anchors 64 --lr 3e-4 \
		--label-source kl --layers 2 --block-size 8 --selector-rank 128 --draft-vocab-size 8192 --mask-token-id 0 \
		--output-scale 0.1 --logit-ramp-steps 0 --eval-every 600 --eval-prompts 8 --eval-max-new-tokens 64 \
		--checkpoint-every 100 --log-every 50 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_s9 runs/finetune_s9/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s9/export --prompts 16 --tokens 64 \
		--output benchmarks/results/heldout_tau_round9.json

# Session 10's fine-tune recipe (from the committed head, KL to the target's top-32), shared by sessions 10, 13, 14.
FINETUNE_RECIPE = --warmup-steps 30 --batch-size 2 --anchors 64 --lr 3e-4 --label-source kl --layers 2 --block-size 8 \
	--selector-rank 128 --draft-vocab-size 8192 --mask-token-id 0 --output-scale 0.1 --logit-ramp-steps 0 \
	--eval-every 100000 --eval-prompts 8 --eval-max-new-tokens 64 --checkpoint-every 100 --log-every 50

# Session 10 (AMD EPYC, AVX-512-BF16: regeneration and training in bf16): 1,536 python-functions completions
# past the 4,024 used before, the target's responses to 2,560 ShareGPT prompts it was trained on in session 8
# (replay), ShareGPT text to 900k tokens; 3,000 steps from the committed head. Resumable at every stage.
finetune-smollm2-s10: setup
	$(VENV)/bin/hf-dflash2 regenerate --prompts python-functions --skip 4024 --output data/regen_code_s10.jsonl \
		--limit 1536 --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 regenerate --skip 6000 --output data/regen_sharegpt_replay_s10.jsonl --limit 2560 \
		--batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 store --output data/store_s10 \
		--source data/regen_code_s10.jsonl,data/regen_sharegpt_replay_s10.jsonl,sharegpt \
		--target-layer-ids 1,7,14,20,27 --max-tokens 900000
	$(VENV)/bin/hf-dflash2 train --store data/store_s10 --init-from heads/smollm2-135m-dflash2 \
		--output runs/finetune_s10 --steps 3000 $(FINETUNE_RECIPE) --stop-after-minutes 50 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_s10 runs/finetune_s10/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s10/export --prompts 32 --tokens 64 \
		--output benchmarks/results/heldout_tau_round10.json

# Session 13: the target's responses to the 2,041 usable ShareGPT prompts never regenerated (past --skip 8560),
# appended to session 10's store (which also took session 10's second round of code data, regen_code_s10b),
# then 4,500 steps from the committed head (stopped by the time limit at 4,140 in session 13). Resumable.
finetune-smollm2-s13: setup
	$(VENV)/bin/hf-dflash2 regenerate --skip 8560 --output data/regen_sharegpt_s13.jsonl --limit 2600 \
		--batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 store --output data/store_s10 \
		--source data/regen_sharegpt_s13.jsonl,data/regen_code_s10b.jsonl,data/regen_code_s10.jsonl,data/regen_sharegpt_replay_s10.jsonl,sharegpt \
		--target-layer-ids 1,7,14,20,27 --max-tokens 1700000
	$(VENV)/bin/hf-dflash2 train --store data/store_s10 --init-from heads/smollm2-135m-dflash2 \
		--output runs/finetune_s13 --steps 4500 $(FINETUNE_RECIPE) --stop-after-minutes 45 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_s13 runs/finetune_s13/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s13/export --prompts 32 --tokens 64 \
		--output benchmarks/results/heldout_tau_round13.json

# Session 14: second turns of the ShareGPT conversations whose first turns the target answered (sessions 10 and
# 13), after the target's own answer (MT-Bench-like chats), appended to the store; then 3,100 steps from the
# committed head. Resumable.
finetune-smollm2-s14: setup
	$(VENV)/bin/hf-dflash2 regenerate \
		--prompts sharegpt-followups:data/regen_sharegpt_s13.jsonl,data/regen_sharegpt_replay_s10.jsonl \
		--output data/regen_followups_s14.jsonl --limit 1000 --max-prompt-tokens 384 --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 store --output data/store_s10 --source data/regen_followups_s14.jsonl \
		--target-layer-ids 1,7,14,20,27 --max-tokens 3000000
	$(VENV)/bin/hf-dflash2 train --store data/store_s10 --init-from heads/smollm2-135m-dflash2 \
		--output runs/finetune_s14 --steps 3100 $(FINETUNE_RECIPE) --stop-after-minutes 40 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_s14 runs/finetune_s14/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s14/export --prompts 32 --tokens 64 \
		--output benchmarks/results/heldout_tau_round14.json

# Session 15: the remaining second turns (resumes session 14's file up to the 2,447 that fit in 384 prompt
# tokens), then 1,000 third turns (after the target's own first two answers), appended to the store; then
# 3,600 steps from the committed head. Resumable.
S15_FIRST_TURNS = data/regen_sharegpt_s13.jsonl,data/regen_sharegpt_replay_s10.jsonl
finetune-smollm2-s15: setup
	$(VENV)/bin/hf-dflash2 regenerate --prompts sharegpt-followups:$(S15_FIRST_TURNS) \
		--output data/regen_followups_s14.jsonl --limit 2447 --max-prompt-tokens 384 --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 regenerate --prompts sharegpt-followups:$(S15_FIRST_TURNS),data/regen_followups_s14.jsonl \
		--output data/regen_followups3_s15.jsonl --limit 1000 --max-prompt-tokens 512 --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 store --output data/store_s10 --source data/regen_followups_s14.jsonl,data/regen_followups3_s15.jsonl \
		--target-layer-ids 1,7,14,20,27 --max-tokens 4000000
	$(VENV)/bin/hf-dflash2 train --store data/store_s10 --init-from heads/smollm2-135m-dflash2 \
		--output runs/finetune_s15 --steps 3600 $(FINETUNE_RECIPE) --stop-after-minutes 45 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_s15 runs/finetune_s15/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s15/export --prompts 32 --tokens 64 \
		--output benchmarks/results/heldout_tau_round15.json

# Session 16: fourth turns (after the target's own first three answers; third turns of the conversations whose
# second turn was long), appended to the store; then 3,000 steps from the committed head. Resumable.
S16_FOLLOWUP_SOURCES = $(S15_FIRST_TURNS),data/regen_followups_s14.jsonl,data/regen_followups3_s15.jsonl
finetune-smollm2-s16: setup
	$(VENV)/bin/hf-dflash2 regenerate --prompts sharegpt-followups:$(S16_FOLLOWUP_SOURCES) \
		--output data/regen_followups4_s16.jsonl --limit 1000 --max-prompt-tokens 640 --batch-size 64 --max-new-tokens 192
	$(VENV)/bin/hf-dflash2 store --output data/store_s10 --source data/regen_followups4_s16.jsonl \
		--target-layer-ids 1,7,14,20,27 --max-tokens 4000000
	$(VENV)/bin/hf-dflash2 train --store data/store_s10 --init-from heads/smollm2-135m-dflash2 \
		--output runs/finetune_s16 --steps 3000 $(FINETUNE_RECIPE) --stop-after-minutes 45 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_s16 runs/finetune_s16/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s16/export --prompts 32 --tokens 64 \
		--output benchmarks/results/heldout_tau_round16.json

# Session 16's records that the store's 512-token sequences dropped (prompt >= 510 tokens), appended whole at
# up to 832 tokens (records already stored are skipped by id); train on them with --max-length 832. Resumable.
store-smollm2-s16-long: setup
	$(VENV)/bin/hf-dflash2 store --output data/store_s10 --source data/regen_followups4_s16.jsonl \
		--target-layer-ids 1,7,14,20,27 --max-tokens 4000000 --max-length 832

# Session 17: 3,000 steps from the committed head on the whole store at up to 832 tokens, so that session 16's
# long fourth turns (appended by store-smollm2-s16-long) are trained on whole. Resumable.
finetune-smollm2-s17: setup
	$(VENV)/bin/hf-dflash2 train --store data/store_s10 --init-from heads/smollm2-135m-dflash2 --max-length 832 \
		--output runs/finetune_s17 --steps 3000 $(FINETUNE_RECIPE) --stop-after-minutes 50 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_s17 runs/finetune_s17/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s17/export --prompts 32 --tokens 64 \
		--output benchmarks/results/heldout_tau_round17.json

# Issue 8's ablation at equal budget (session 7): dFlash 2 and DFlash-1 from scratch on the 6,000-response
# store, same data order, steps and seed, one thread each side by side; then held-out tau of both.
ABLATION_ARGS = --store data/store_regen6000 --steps 1500 --warmup-steps 60 --batch-size 2 --anchors 64 --lr 1e-3 \
	--label-source kl --layers 2 --block-size 8 --selector-rank 128 --draft-vocab-size 8192 --mask-token-id 0 \
	--output-scale 0.1 --logit-ramp-steps 0 --eval-every 1500 --eval-prompts 8 --eval-max-new-tokens 64 \
	--checkpoint-every 100 --log-every 50 --threads 1 --seed 0 --resume
# The pair's recipe: $(1) training arguments, $(2) run folder (one subfolder per arm), $(3) held-out tau JSON.
define ABLATION_PAIR
	$(VENV)/bin/hf-dflash2 train $(1) --output $(2)/dflash2 & \
	$(VENV)/bin/hf-dflash2 train $(1) --dflash1 --output $(2)/dflash1; wait
	for arm in dflash2 dflash1; do $(PY) -m hf_dflash2.training.export $(2)/$$arm $(2)/$$arm/export; done
	$(PY) benchmarks/heldout_tau.py $(2)/dflash2/export $(2)/dflash1/export --prompts 16 \
		--tokens 64 --output $(3)
endef
ablation-smollm2: setup
	$(call ABLATION_PAIR,$(ABLATION_ARGS),runs/ablation6000,benchmarks/results/ablation_round7.json)

# Session 14: the same pair on the 1.70M-token store (store_s10), 2,400 steps each; then held-out tau of both
# (linear rounds) and tree_shapes for both (dFlash 2 ranks trees by its selector, DFlash-1 by unary scores).
ABLATION14_ARGS = $(subst --eval-every 1500,--eval-every 100000,$(subst data/store_regen6000,data/store_s10,$(subst --steps 1500,--steps 2400,$(ABLATION_ARGS))))
ablation-smollm2-s14: setup
	$(call ABLATION_PAIR,$(ABLATION14_ARGS),runs/ablation_s14,benchmarks/results/ablation_round14.json)
	$(PY) benchmarks/tree_shapes.py --heads runs/ablation_s14/dflash2/export,runs/ablation_s14/dflash1/export \
		--output ablation_trees_round14

# Session 17: the session 14 pair continued to 4,800 steps each (the cosine schedule is re-read at the new
# length, so both restart warm at half the peak rate), same data order and seed; then held-out tau of both.
# Resumes in runs/ablation_s14 and replaces its 2,400-step checkpoints and exports (their held-out tau is
# kept in benchmarks/results/ablation_round14.json).
ABLATION17_ARGS = $(subst --steps 2400,--steps 4800,$(ABLATION14_ARGS))
ablation-smollm2-s17: setup
	$(call ABLATION_PAIR,$(ABLATION17_ARGS),runs/ablation_s14,benchmarks/results/ablation_round17.json)

# The earlier recipe: the target's own regenerated responses, the target run online while training.
regenerate-smollm2: setup
	$(VENV)/bin/hf-dflash2 regenerate --output data/smollm2_sharegpt.jsonl --limit 3000

# Session 20: the regenerated data of sessions 6-16 is gone with their work trees, so the store for the next head
# starts again: the target's greedy responses to every usable ShareGPT prompt (first turns, seeded order), then
# code-shaped completions. Resumable (run it again to continue; --linear-kernel auto packs the target where oneDNN
# is faster at batch 64). At 250-300 tok/s on 2 cores this is hours: it spans sessions.
regenerate-smollm2-s20: setup
	$(VENV)/bin/hf-dflash2 regenerate --output data/regen_sharegpt_s20.jsonl --limit 10600 --batch-size 64 \
		--max-new-tokens 192
	$(VENV)/bin/hf-dflash2 regenerate --prompts python-functions --output data/regen_code_s20.jsonl --limit 6000 \
		--batch-size 64 --max-new-tokens 192

# Session 21: the committed head grown to 3 layers (`train --init-from` copies its last layer with the residual
# outputs zeroed, so training starts from exactly the committed head) and trained on whatever
# regenerate-smollm2-s20 holds (first-turn responses and code completions), topped up with ShareGPT's own text
# (a prefill is ~8x cheaper per token than regenerating; KL labels are the target's own distribution either way)
# to GROW_STORE_TOKENS; up to 832 tokens per sequence.
# The selector is pruned from rank 128 to its 96 strongest coordinates: its [V, rank] codebooks are most of the
# head's bytes, and the freed 6.3 MB make room for the layer (7.1 MB) in the 64 MiB tracked tree.
# Each stage resumes; the head replaces the committed one only if it wins on held-out tau.
# Session 22 ran it (GROW_STEPS 2200, ~1 hour on 2 AMX cores): held-out tau 2.04 / 1.53 against the committed
# head's 2.05 / 1.47; not adopted (docs/results-log.md).
GROW_RECIPE = $(subst --selector-rank 128,--selector-rank 96,$(subst --layers 2,--layers 3,$(FINETUNE_RECIPE))) \
	--target-layer-ids 1,7,14,20,27
GROW_STEPS ?= 2200
GROW_STORE_TOKENS ?= 1500000
store-smollm2-s21: setup
	$(VENV)/bin/hf-dflash2 store --output data/store_s21 \
		--source data/regen_sharegpt_s20.jsonl,data/regen_code_s20.jsonl,sharegpt \
		--target-layer-ids 1,7,14,20,27 --max-tokens $(GROW_STORE_TOKENS) --max-length 832

grow-smollm2-s21: store-smollm2-s21
	$(VENV)/bin/hf-dflash2 train --store data/store_s21 --init-from heads/smollm2-135m-dflash2 --max-length 832 \
		--output runs/grow3_s21 --steps $(GROW_STEPS) $(GROW_RECIPE) --stop-after-minutes 65 --resume
	$(PY) -m hf_dflash2.training.export runs/grow3_s21 runs/grow3_s21/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/grow3_s21/export --prompts 32 --tokens 64 \
		--output benchmarks/results/heldout_tau_round21.json

# Session 22's control for the grown head: the committed head's own shape (2 layers, rank 128), 1,500 steps on
# the same store (~35 min). Held-out tau 2.08 / 1.49 against 2.05 / 1.47: a small win, adopted in session 23.
# The higher-rate arm: make finetune-smollm2-s22 S22_LR=1e-3 S22_STEPS=1000 S22_NAME=s22_lr1e3 (1.99 / 1.44, worse).
S22_LR ?= 3e-4
S22_STEPS ?= 1500
S22_NAME ?= s22
finetune-smollm2-s22: store-smollm2-s21
	$(VENV)/bin/hf-dflash2 train --store data/store_s21 --init-from heads/smollm2-135m-dflash2 --max-length 832 \
		--output runs/finetune_$(S22_NAME) --steps $(S22_STEPS) $(subst --lr 3e-4,--lr $(S22_LR),$(FINETUNE_RECIPE)) \
		--target-layer-ids 1,7,14,20,27 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_$(S22_NAME) runs/finetune_$(S22_NAME)/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_$(S22_NAME)/export --prompts 32 \
		--tokens 64 --output benchmarks/results/heldout_tau_round$(patsubst s%,%,$(S22_NAME)).json

# Session 23: the committed head (session 22's) fine-tuned on the store's regenerated records only (the
# target's own ShareGPT responses and code completions, ~300K tokens, 1,920 sequences): the text that
# speculative decoding meets, against a mix that is 70 % ShareGPT's own text. 900 steps ~ one epoch, ~22 min.
# Like every fine-tune here it starts from the committed head of its time: the arms of session 23 started from
# session 22's head (git checkout a3f1209 -- heads/smollm2-135m-dflash2), the second epoch from the argmax one.
S23_STEPS ?= 900
S23_SEED ?= 0
S23_LABELS ?= kl
S23_NAME ?= s23_regen
finetune-smollm2-s23: store-smollm2-s21
	$(VENV)/bin/hf-dflash2 train --store data/store_s21 --records regen/ --init-from heads/smollm2-135m-dflash2 \
		--max-length 832 --output runs/finetune_$(S23_NAME) --steps $(S23_STEPS) --seed $(S23_SEED) \
		$(subst --label-source kl,--label-source $(S23_LABELS),$(FINETUNE_RECIPE)) --target-layer-ids 1,7,14,20,27 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_$(S23_NAME) runs/finetune_$(S23_NAME)/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_$(S23_NAME)/export --prompts 32 \
		--tokens 64 --output benchmarks/results/heldout_tau_round$(patsubst s%,%,$(S23_NAME)).json

# Session 24: a store over every regenerated record (the target's own greedy text only: ~4,000 first-turn
# ShareGPT responses from regenerate-smollm2-s20, which kept running in session 23, and 1,088 code completions),
# then one argmax epoch from the committed head (2,500 steps of 2 sequences over 5,056: session 23's adopted
# recipe, scaled to the new data).
# Each stage resumes; the head replaces the committed one only if it wins on held-out tau on both sets.
# Session 24 ran it (2.08 / 1.51 against 2.14 / 1.50) and, from that head, a code epoch
# (S24_NAME=s24_code S24_INIT=runs/finetune_s24/export S24_RECORDS=regen/python/ S24_STEPS=544: 2.21 / 1.48)
# and half of one (S24_NAME=s24_code_half ... S24_STEPS=272: 2.15 / 1.49); none adopted (docs/results-log.md).
S24_STEPS ?= 2500
S24_SEED ?= 0
S24_NAME ?= s24
S24_INIT ?= heads/smollm2-135m-dflash2
S24_RECORDS ?= regen/
S24_LR ?= 3e-4
# 0: every sequence. Session 24's arms saw the store's first 5,056 (S24_MAX_SEQUENCES=5056; 1,088 with
# S24_RECORDS=regen/python/), before session 25 appended 3,648 code completions.
S24_MAX_SEQUENCES ?= 0
store-smollm2-s24: setup
	$(VENV)/bin/hf-dflash2 store --output data/store_s24 \
		--source data/regen_sharegpt_s20.jsonl,data/regen_code_s20.jsonl --target-layer-ids 1,7,14,20,27 --max-length 832 \
		--max-tokens 4000000

finetune-smollm2-s24: store-smollm2-s24
	$(VENV)/bin/hf-dflash2 train --store data/store_s24 --records $(S24_RECORDS) --init-from $(S24_INIT) \
		--max-length 832 --output runs/finetune_$(S24_NAME) --steps $(S24_STEPS) --seed $(S24_SEED) \
		--max-sequences $(S24_MAX_SEQUENCES) \
		$(subst --lr 3e-4,--lr $(S24_LR),$(subst --label-source kl,--label-source argmax,$(FINETUNE_RECIPE))) \
		--target-layer-ids 1,7,14,20,27 --resume
	$(PY) -m hf_dflash2.training.export runs/finetune_$(S24_NAME) runs/finetune_$(S24_NAME)/export
	$(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_$(S24_NAME)/export --prompts 32 \
		--tokens 64 --output benchmarks/results/heldout_tau_round$(patsubst s%,%,$(S24_NAME)).json

# Session 25: the committed head. Two fine-tunes of session 23's head (git checkout 3e2f4ea --
# heads/smollm2-135m-dflash2 before building them) averaged weight by weight (hf-dflash2 average):
#   make finetune-smollm2-s24 S24_NAME=s25_mix S24_STEPS=3000   (all 8,704 records, 55 % code; 2.22 / 1.54)
#   make finetune-smollm2-s24 S24_MAX_SEQUENCES=5056, then
#   make finetune-smollm2-s24 S24_NAME=s24_code S24_INIT=runs/finetune_s24/export S24_RECORDS=regen/python/ \
#        S24_STEPS=544 S24_MAX_SEQUENCES=1088   (2.21 / 1.48)
# Their mean: held-out tau 2.29 / 1.54 (docs/results-log.md, session 25).
SOUP_NAME ?= s25_c1
SOUP_HEADS ?= runs/finetune_s25_mix/export runs/finetune_s24_code/export
SOUP_WEIGHTS ?= 1,1
# The head the mean is compared with. Sessions 25-28 the committed head was this mean itself; session 25
# compared with session 23's (mkdir -p runs/s23_head && git archive 3e2f4ea heads/smollm2-135m-dflash2 |
# tar -x --strip-components=2 -C runs/s23_head, then SOUP_BASELINE=runs/s23_head).
SOUP_BASELINE ?= heads/smollm2-135m-dflash2
soup-smollm2-s25: setup
	$(VENV)/bin/hf-dflash2 average $(SOUP_HEADS) --weights $(SOUP_WEIGHTS) --output runs/soup_$(SOUP_NAME)
	$(PY) benchmarks/heldout_tau.py $(SOUP_BASELINE) runs/soup_$(SOUP_NAME) --prompts 32 \
		--tokens 64 --output benchmarks/results/heldout_tau_round25_soup_$(SOUP_NAME).json

# Session 26: fresh data only. The work tree that held session 25's stores was gone, so instead of rebuilding
# them (the committed head has trained on them), the target answers prompts no committed head has seen:
# ShareGPT first turns past the 5,120 regenerate-smollm2-s20 answered, python-functions past its 4,736.
# A fine-tune of the committed head on them (argmax labels, the session 24 recipe) that also keeps a moving
# average of its weights (--ema-decay 0.998, exported beside the last step's), then the mean of each with the
# committed head; held-out tau on both prompt slices decides (session 26 ran the last mean's held-out tau on
# its own: heldout_tau_round26_soup_ema_slice*.json). Each stage resumes where it stopped.
S26_RECORDS ?= 2048
S26_STEPS ?= 2000
S26_NAME ?= s26_fresh
# Plain-prompt regeneration for a session's store: ShareGPT first turns into data/regen_sharegpt_$(1).jsonl from
# prompt $(2) on, python-functions prompts into data/regen_code_$(1).jsonl from prompt $(3) on, $(4) of each,
# plus the regenerate arguments $(5); resumable.
define regenerate_pair
	$(VENV)/bin/hf-dflash2 regenerate --output data/regen_sharegpt_$(1).jsonl --skip $(2) --limit $(4) \
		--batch-size 64 --max-new-tokens 192 $(5)
	$(VENV)/bin/hf-dflash2 regenerate --prompts python-functions --output data/regen_code_$(1).jsonl --skip $(3) \
		--limit $(4) --batch-size 64 --max-new-tokens 192 $(5)
endef

# A run's last weights and moving average as heads: RUN/export and RUN/export_ema.
define export_run
	$(PY) -m hf_dflash2.training.export $(1) $(1)/export
	$(PY) -m hf_dflash2.training.export $(1) $(1)/export_ema --ema
endef

regenerate-smollm2-s26: setup
	$(call regenerate_pair,s26,5120,4736,$(S26_RECORDS),)

store-smollm2-s26: regenerate-smollm2-s26
	$(VENV)/bin/hf-dflash2 store --output data/store_s26 \
		--source data/regen_sharegpt_s26.jsonl,data/regen_code_s26.jsonl --target-layer-ids 1,7,14,20,27 \
		--max-length 832 --max-tokens 4000000

# $(call finetune_committed,STORE,RUN,EXTRA): session 26's fine-tune of the committed head (argmax labels, a
# moving average), then both exports; EXTRA adds train options.
# The committed head's taps; a run tapping more (a superset) starts the new taps' fc columns at zero.
FINETUNE_TAPS ?= 1,7,14,20,27
define finetune_committed
	$(VENV)/bin/hf-dflash2 train --store $(1) --init-from heads/smollm2-135m-dflash2 --max-length 832 \
		--output $(2) --steps $(S26_STEPS) \
		$(subst --label-source kl,--label-source argmax,$(FINETUNE_RECIPE)) --target-layer-ids $(FINETUNE_TAPS) \
		--ema-decay 0.998 $(3) --resume
	$(call export_run,$(2))
endef

finetune-smollm2-s26: store-smollm2-s26
	$(call finetune_committed,data/store_s26,runs/finetune_$(S26_NAME),)
	$(VENV)/bin/hf-dflash2 average heads/smollm2-135m-dflash2 runs/finetune_$(S26_NAME)/export \
		--output runs/soup_$(S26_NAME)
	$(VENV)/bin/hf-dflash2 average heads/smollm2-135m-dflash2 runs/finetune_$(S26_NAME)/export_ema \
		--output runs/soup_$(S26_NAME)_ema
	for slice in 0 1; do $(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_$(S26_NAME)/export \
		runs/finetune_$(S26_NAME)/export_ema runs/soup_$(S26_NAME) runs/soup_$(S26_NAME)_ema \
		--prompts 32 --tokens 64 --prompt-slice $$slice \
		--output benchmarks/results/heldout_tau_round26_slice$$slice.json || exit 1; done

# Session 26's capacity arm: the committed head grown to 3 layers (selector pruned to rank 96, as in session 22)
# on the same fresh store, argmax labels, a moving average; bounded to 26 minutes (resumable).
grow-smollm2-s26: store-smollm2-s26
	$(VENV)/bin/hf-dflash2 train --store data/store_s26 --init-from heads/smollm2-135m-dflash2 --max-length 832 \
		--output runs/grow3_s26 --steps 1800 $(subst --label-source kl,--label-source argmax,$(GROW_RECIPE)) \
		--ema-decay 0.998 --stop-after-minutes 26 --resume
	$(PY) -m hf_dflash2.training.export runs/grow3_s26 runs/grow3_s26/export
	$(PY) -m hf_dflash2.training.export runs/grow3_s26 runs/grow3_s26/export_ema --ema
	for slice in 0 1; do $(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/grow3_s26/export \
		runs/grow3_s26/export_ema --prompts 32 --tokens 64 --prompt-slice $$slice \
		--output benchmarks/results/heldout_tau_round26_grow3_slice$$slice.json || exit 1; done

# Session 28: another training signal on the same text. Session 26's fresh responses stored again with the
# target's LM-head input per token (--final-hidden, +1.2 GB), then session 26's fine-tune (same data, steps,
# seed: its arm is the control) with a loss pulling the head's LM-head input towards the target's
# (--hidden-weight). Held-out tau on both prompt slices decides. Each stage resumes where it stopped.
S28_HIDDEN_WEIGHT ?= 1.0
S28_NAME ?= s28_hidden1
store-smollm2-s28: regenerate-smollm2-s26
	$(VENV)/bin/hf-dflash2 store --output data/store_s28 --final-hidden \
		--source data/regen_sharegpt_s26.jsonl,data/regen_code_s26.jsonl --target-layer-ids 1,7,14,20,27 \
		--max-length 832 --max-tokens 4000000

finetune-smollm2-s28: store-smollm2-s28
	$(call finetune_committed,data/store_s28,runs/finetune_$(S28_NAME),--hidden-weight $(S28_HIDDEN_WEIGHT))
	for slice in 0 1; do $(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_$(S28_NAME)/export \
		runs/finetune_$(S28_NAME)/export_ema --prompts 32 --tokens 64 --prompt-slice $$slice \
		--output benchmarks/results/heldout_tau_round28_$(S28_NAME)_slice$$slice.json || exit 1; done

# Session 28's control: the same fine-tune at --hidden-weight 0 (session 26's arm again), then the committed
# head and both moving averages on four prompt slices no head was chosen on (2-5).
# Since session 29 the committed head is this run's moving average (runs/finetune_s28_hidden0/export_ema, chosen
# on held-out tau pooled over slices 1-9); it starts from session 25's head: git checkout 10167c4 --
# heads/smollm2-135m-dflash2 before re-running it.
control-smollm2-s28: finetune-smollm2-s28
	$(MAKE) finetune-smollm2-s28 S28_NAME=s28_hidden0 S28_HIDDEN_WEIGHT=0
	for slice in 2 3 4 5; do $(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/finetune_s28_hidden0/export_ema \
		runs/finetune_s28_hidden1/export_ema --prompts 32 --tokens 64 --prompt-slice $$slice \
		--output benchmarks/results/heldout_tau_round28_slice$$slice.json || exit 1; done

# Session 29: the same fine-tune (session 26's recipe on session 28's store; the W = 0 arm above is the control)
# with a steeper position decay of the loss, --loss-gamma $(S29_GAMMA) against the paper's 4 at B = 8; then
# held-out tau of its moving average on all ten prompt slices, pooled against the control by heldout_slices.py.
S29_GAMMA ?= 2
S29_NAME ?= s29_gamma$(S29_GAMMA)
finetune-smollm2-s29: store-smollm2-s28
	$(call finetune_committed,data/store_s28,runs/finetune_$(S29_NAME),--loss-gamma $(S29_GAMMA))
	for slice in 0 1 2 3 4 5 6 7 8 9; do $(PY) benchmarks/heldout_tau.py runs/finetune_$(S29_NAME)/export_ema \
		--prompts 32 --tokens 64 --prompt-slice $$slice \
		--output benchmarks/results/heldout_tau_round29_$(S29_NAME)_slice$$slice.json || exit 1; done


# Session 33: does a head fine-tuned on penalized text accept more under a penalty? The target's responses
# decoded with --repetition-penalty 1.2 (the ShareGPT first turns and python-functions prompts session 26
# answered without one), a store of them, session 26's fine-tune of the committed head for S33_STEPS steps,
# then benchmarks/penalty_drafts.py on the fine-tune's last step and its moving average (the committed head's
# figures: python benchmarks/penalty_drafts.py, penalty_drafts_<cpu kind>.md).
S33_RECORDS ?= 1024
S33_STEPS ?= 400
S33_PENALTY ?= 1.2
regenerate-smollm2-s33: setup
	$(call regenerate_pair,s33_penalty,5120,4736,$(S33_RECORDS),--repetition-penalty $(S33_PENALTY))

store-smollm2-s33: regenerate-smollm2-s33
	$(VENV)/bin/hf-dflash2 store --output data/store_s33_penalty \
		--source data/regen_sharegpt_s33_penalty.jsonl,data/regen_code_s33_penalty.jsonl \
		--target-layer-ids 1,7,14,20,27 --max-length 832

finetune-smollm2-s33: S26_STEPS = $(S33_STEPS)
finetune-smollm2-s33: store-smollm2-s33
	$(call finetune_committed,data/store_s33_penalty,runs/finetune_s33_penalty,)
	for export in export export_ema; do $(PY) benchmarks/penalty_drafts.py --penalty $(S33_PENALTY) \
		--head runs/finetune_s33_penalty/$$export --output penalty_drafts_s33_finetuned_$$export || exit 1; done

# Session 34: the penalized text mixed with plain text, so that the head learns the penalized target without
# forgetting the plain one. Plain greedy responses to the other half of session 26's prompts (the half session 33
# did not decode under a penalty, so record ids do not collide), appended to a copy of session 33's store; the
# committed head fine-tuned on the mix for S34_STEPS steps; then held-out tau with and without the penalty.
S34_RECORDS ?= 1024
S34_STEPS ?= 800
S34_NAME ?= s34_mix
regenerate-smollm2-s34: setup
	$(call regenerate_pair,s34_plain,$$((5120 + $(S33_RECORDS))),$$((4736 + $(S33_RECORDS))),$(S34_RECORDS),)

store-smollm2-s34: store-smollm2-s33 regenerate-smollm2-s34
	test -d data/store_s34_mix || cp -r data/store_s33_penalty data/store_s34_mix
	$(VENV)/bin/hf-dflash2 store --output data/store_s34_mix --max-tokens 3000000 \
		--source data/regen_sharegpt_s33_penalty.jsonl,data/regen_code_s33_penalty.jsonl,data/regen_sharegpt_s34_plain.jsonl,data/regen_code_s34_plain.jsonl \
		--target-layer-ids 1,7,14,20,27 --max-length 832

finetune-smollm2-s34: S26_STEPS = $(S34_STEPS)
finetune-smollm2-s34: store-smollm2-s34
	$(call finetune_committed,data/store_s34_mix,runs/finetune_$(S34_NAME),)
	for penalty in 1.2 1.0; do $(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 \
		runs/finetune_$(S34_NAME)/export runs/finetune_$(S34_NAME)/export_ema --prompts 16 --tokens 64 \
		--repetition-penalty $$penalty --output benchmarks/results/heldout_tau_round34_$(S34_NAME)_penalty$$penalty.json \
		|| exit 1; done

# Session 34's label arms on session 33's penalized store alone (same steps as session 33's argmax run): the
# target's top-32 distribution (kl), or the penalized token itself (data). The loop applies the penalty to the
# head's logits, so a head whose logits follow the target's raw ones should rank the penalized choice as the
# target does; held-out tau with and without the penalty decides.
S34_ARM ?= kl
arm-smollm2-s34: S26_STEPS = $(S33_STEPS)
arm-smollm2-s34: store-smollm2-s33
	$(call finetune_committed,data/store_s33_penalty,runs/finetune_s34_penalty_$(S34_ARM),--label-source $(S34_ARM))

# Session 35: does the head gain from the target's last state, the normed one its LM head reads (hidden_states
# index 30, tapped as layer 29), as a sixth tap? One store over session 34's plain text keeps layers
# 1,7,14,20,27,29; two arms from the committed head with the same data, steps and seed: its own five taps
# (S35_ARM=five, the control) and all six (S35_ARM=six: the new tap's fc columns start at zero, so the arm
# starts as the committed head). Held-out tau on prompt slices 0-2 decides.
S35_STEPS ?= 800
S35_ARM ?= six
S35_TAPS_five := 1,7,14,20,27
S35_TAPS_six := 1,7,14,20,27,29
store-smollm2-s35: regenerate-smollm2-s34
	$(VENV)/bin/hf-dflash2 store --output data/store_s35_taps --max-tokens 3000000 \
		--source data/regen_sharegpt_s34_plain.jsonl,data/regen_code_s34_plain.jsonl \
		--target-layer-ids $(S35_TAPS_six) --max-length 832

arm-smollm2-s35: S26_STEPS = $(S35_STEPS)
arm-smollm2-s35: FINETUNE_TAPS = $(S35_TAPS_$(S35_ARM))
arm-smollm2-s35: store-smollm2-s35
	$(call finetune_committed,data/store_s35_taps,runs/taps_s35_$(S35_ARM),)

# Session 35: the mean of the committed head and the three penalty-aware fine-tunes of sessions 33-34
# (their moving averages: session 33's argmax run, session 34's KL-label arm and its mix), held-out tau with and
# without the penalty on slices 0-2, and without it on slices 3-9 (the committed head beside it there).
S35_SOUP := heads/smollm2-135m-dflash2 runs/finetune_s33_penalty/export_ema runs/finetune_s34_penalty_kl/export_ema \
	runs/finetune_s34_mix/export_ema
soup-smollm2-s35: setup
	$(VENV)/bin/hf-dflash2 average $(S35_SOUP) --output runs/soup_s35/four
	for slice in 0 1 2; do for penalty in 1.0 1.2; do $(PY) benchmarks/heldout_tau.py runs/soup_s35/four \
		--prompts 16 --tokens 64 --prompt-slice $$slice --repetition-penalty $$penalty \
		--output benchmarks/results/heldout_tau_round35_soup_slice$${slice}_penalty$$penalty.json || exit 1; done; done
	for slice in 3 4 5 6 7 8 9; do $(PY) benchmarks/heldout_tau.py heads/smollm2-135m-dflash2 runs/soup_s35/four \
		--prompts 16 --tokens 64 --prompt-slice $$slice --repetition-penalty 1.0 \
		--output benchmarks/results/heldout_tau_round35_soup_slice$${slice}_penalty1.0.json || exit 1; done

# Session 38: does a fresh head learn faster per CPU-hour when its layers start as copies of the target's last
# two (28, 29), which already map a residual stream to what the shared final norm and LM head read? Two arms
# from scratch with the same data, steps, seed and recipe, one thread each side by side: S38_ARM=fresh (the
# control) and S38_ARM=target (--init-layers-from-target 28,29); then held-out tau of both exports on slices 0-1.
# A third arm: S38_ARM=target S38_LR=3e-4 S38_NAME=target_lr3e-4 (does a lower rate keep more of the copy?).
S38_STEPS ?= 2000
S38_ARM ?= target
S38_LR ?= 1e-3
S38_NAME ?= $(S38_ARM)
S38_INIT_fresh :=
S38_INIT_target := --init-layers-from-target 28,29
S38_ARGS = --store data/store_s35_taps --target-layer-ids 1,7,14,20,27 --max-length 832 --steps $(S38_STEPS) \
	--warmup-steps 60 --batch-size 2 --anchors 64 --lr $(S38_LR) --label-source argmax --layers 2 --block-size 8 \
	--selector-rank 128 --draft-vocab-size 8192 --mask-token-id 0 --output-scale 0.1 --logit-ramp-steps 0 \
	--ema-decay 0.998 --eval-every 100000 --eval-prompts 8 --eval-max-new-tokens 64 --checkpoint-every 100 \
	--log-every 50 --threads 1 --seed 0 --resume
arm-smollm2-s38: store-smollm2-s35
	$(VENV)/bin/hf-dflash2 train $(S38_ARGS) $(S38_INIT_$(S38_ARM)) --output runs/init_s38_$(S38_NAME)
	$(call export_run,runs/init_s38_$(S38_NAME))

# Session 38's follow-up: more of the target's own text for a long run from target-initialised layers (the arms
# above trained 5 epochs of store_s35_taps). ShareGPT first turns and python-functions prompts past those of
# sessions 26-34, plain greedy; resumable (run it again to continue). Then store-smollm2-s38 appends them to a
# copy of store_s35_taps.
S38_RECORDS ?= 2048
regenerate-smollm2-s38: setup
	$(call regenerate_pair,s38,7168,6784,$(S38_RECORDS),)

store-smollm2-s38: regenerate-smollm2-s38
	test -d data/store_s38 || cp -r data/store_s35_taps data/store_s38
	$(VENV)/bin/hf-dflash2 store --output data/store_s38 --max-tokens 3000000 \
		--source data/regen_sharegpt_s34_plain.jsonl,data/regen_code_s34_plain.jsonl,data/regen_sharegpt_s38.jsonl,data/regen_code_s38.jsonl \
		--target-layer-ids 1,7,14,20,27,29 --max-length 832

# The long run session 38 points to, as session 40 runs it: a new lineage from the target's last two layers on
# data/store_s38 (1.5M tokens), both threads. A cosine schedule needs its length at step 0, and a run that
# spans sessions does not know it; so the trunk trains at a constant rate (--lr-schedule wsd with a length it
# never reaches), stopping after S40_MINUTES each call and resuming where it stopped. `make cool-smollm2-s40`
# copies the trunk's checkpoint (then reads its step from the copy: the trunk rewrites its own every 100 steps)
# and cools the copy down over S40_COOL steps (the rate 1 - sqrt down to 0) into a finished head, exported,
# while the trunk goes on (run again, it starts a new copy; an interrupted one resumes with the same train
# arguments, --steps <its step + S40_COOL> and --output runs/long_s40_cool<its step>). The trainer's held-out evaluation every 2,500 steps
# draws the trunk's curve (`python benchmarks/tau_curve.py runs/long_s40_trunk`).
# Session 41: the cool-down of trunk step 14,129 (14,129 steps in two calls, ~145 minutes, then `make cool-smollm2-s40`;
# runs/long_s40_cool14129/export, last weights) is the committed head heads/smollm2-135m-dflash2.
# Session 43: `make long-smollm2-s40 S40_MINUTES=92` (to step 21,882), then `make cool-smollm2-s40 S40_COOL=2000`:
# a tie with the committed head on held-out tau (docs/results-log.md, Session 43), not adopted.
S40_TRUNK := runs/long_s40_trunk
S40_MINUTES ?= 150
S40_COOL ?= 1500
S40_ARGS = $(subst --threads 1,--threads 2,$(subst --eval-every 100000,--eval-every 2500,$(subst \
	--steps $(S38_STEPS),--steps 1000000,$(subst data/store_s35_taps,data/store_s38,$(S38_ARGS))))) \
	--lr-schedule wsd --init-layers-from-target last
long-smollm2-s40: store-smollm2-s38
	$(VENV)/bin/hf-dflash2 train $(S40_ARGS) --output $(S40_TRUNK) --stop-after-minutes $(S40_MINUTES)

cool-smollm2-s40: setup
	mkdir -p runs && copy=$$(mktemp -p runs .cool_s40.XXXXXX) && cp $(S40_TRUNK)/checkpoint.pt $$copy && \
	step=$$($(PY) -c "import torch; print(torch.load('$$copy', weights_only=False, mmap=True)['step'])") && \
	out=runs/long_s40_cool$$step && mkdir -p $$out && mv $$copy $$out/checkpoint.pt && \
	$(VENV)/bin/hf-dflash2 train $(subst --steps 1000000,--steps $$((step + $(S40_COOL))),$(S40_ARGS)) \
		--decay-steps $(S40_COOL) --output $$out && \
	$(PY) -m hf_dflash2.training.export $$out $$out/export && \
	$(PY) -m hf_dflash2.training.export $$out $$out/export_ema --ema

# Session 39: does the head learn faster still when its context projection also starts as the target's? Two arms
# from scratch on session 38's store (store_s35_taps, 552K tokens; a fresh checkout rebuilds it in ~25 minutes
# here), same data order, seed and recipe as session 38's arms, one thread each side by side: S39_ARM=layers (the target's last two layers, session 38's better arm, the control) and
# S39_ARM=context (the same, plus --init-context-from-target: fc passes tap 27, the input of layer 28, and
# hidden_norm takes that layer's input norm, so the first head layer starts with the target's own context keys
# and values; the head's q/k norms start at the target layers' query / key RMS, which a Llama target has no norm
# for: one arm for both, the whole attention as the target's). The trainer's held-out evaluation every S39_EVAL steps draws each arm's curve; the arm stops
# after S39_MINUTES (resumable) and exports; then held-out tau of the exports on slices 0-1.
S39_ARM ?= context
S39_STEPS ?= 7000
S39_EVAL ?= 1000
S39_MINUTES ?= 110
S39_INIT_layers := --init-layers-from-target last
S39_INIT_context := --init-layers-from-target last --init-context-from-target
S39_ARGS = $(subst --eval-every 100000,--eval-every $(S39_EVAL),$(subst --steps $(S38_STEPS),--steps $(S39_STEPS),$(S38_ARGS)))
arm-smollm2-s39: store-smollm2-s35
	$(VENV)/bin/hf-dflash2 train $(S39_ARGS) $(S39_INIT_$(S39_ARM)) --output runs/s39_$(S39_ARM) \
		--stop-after-minutes $(S39_MINUTES)
	$(call export_run,runs/s39_$(S39_ARM))

# Session 42: issue 8's ablation again, with today's recipe. Session 17's pair (+0.12) was trained from scratch on
# an old store; since then the heads start from the target's last two layers. The dFlash 2 arm is session 39's
# layers arm (runs/s39_layers: S39_ARGS, --init-layers-from-target last, --steps 7000 up to step 1,800, then
# resumed with --steps 6000 to the end); the DFlash-1 arm replays exactly that: same data order, seed, steps and
# schedule, two threads (the thread count changes speed, not the recipe). Phase one runs only in a fresh run
# folder; run the target again to continue phase two. Held-out tau of the pair is not part of the target: the
# heldout_tau.py / heldout_slices.py commands on slices 0-5 are in docs/results-log.md, Session 42.
ABLATION42_RUN := runs/s42_dflash1
ABLATION42_ARGS = $(subst --threads 1,--threads 2,$(S39_ARGS)) $(S39_INIT_layers) --dflash1 --output $(ABLATION42_RUN)
ablation-smollm2-s42: S39_STEPS = 7000
ablation-smollm2-s42: store-smollm2-s35
	test -f $(ABLATION42_RUN)/checkpoint.pt || $(VENV)/bin/hf-dflash2 train $(ABLATION42_ARGS) --stop-after 1800
	$(VENV)/bin/hf-dflash2 train $(subst --steps 7000,--steps 6000,$(ABLATION42_ARGS)) --resume
	$(call export_run,$(ABLATION42_RUN))

# Session 42: does a head that learns less of what the n-gram chain already drafts make the default loop faster?
# The committed head's own cool-down (trunk step 14,129 + 1,500 steps, copy weight 1) is the control; this arm
# repeats it from the same checkpoint (kept in S42_FROM) with --copy-weight S42_COPY: the same data order, seed
# and schedule. The trainer refuses a resume under another objective, so the fork's checkpoint records the new
# copy weight before it resumes. Then the default loop on equal text (ngram_hybrid.py) and held-out tau on
# slices 0-3 (docs/results-log.md, Session 42).
S42_FROM ?= runs/long_s40_trunk_14129
S42_COPY ?= 0.25
S42_RUN = runs/long_s40_cool14129_copy$(subst 0.,,$(S42_COPY))
cool-copy-smollm2-s42: setup
	test -f $(S42_RUN)/checkpoint.pt || (mkdir -p $(S42_RUN) && $(PY) -c "import torch; s = torch.load('$(S42_FROM)/checkpoint.pt', \
		weights_only=False); s['config']['copy_weight'] = $(S42_COPY); torch.save(s, '$(S42_RUN)/checkpoint.pt')")
	step=$$($(PY) -c "import torch; print(torch.load('$(S42_FROM)/checkpoint.pt', weights_only=False, mmap=True)['step'])") && \
	$(VENV)/bin/hf-dflash2 train $(subst --steps 1000000,--steps $$((step + $(S40_COOL))),$(S40_ARGS)) \
		--decay-steps $(S40_COOL) --copy-weight $(S42_COPY) --output $(S42_RUN)
	$(PY) -m hf_dflash2.training.export $(S42_RUN) $(S42_RUN)/export
