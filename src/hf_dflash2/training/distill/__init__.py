"""``hf-dflash2 distill``: a dFlash 2 head for any causal LM, in one command, within a wall-clock budget.

    hf-dflash2 distill --target MODEL --output DIR [--budget 3h] [--push REPO] [--gguf-file F] [--chat-template T]

The recipe that moved held-out τ on SmolLM2-135M, end to end, with the pieces the other commands use:

1. **check**     refuse, by name and before anything is written, a target the head cannot serve: an
                 encoder-decoder, no decoder layers or too few for the taps, no input / output embeddings of
                 one size (the head reads the target's embedding and drafts through its LM head), no hidden
                 states.
2. **probe**     measure this machine on this target: regeneration tokens per second (the run's first batch,
                 kept), prefill tokens per second and seconds per training step (a throwaway store and head),
                 seconds per greedy token.
3. **plan**      split ``--budget`` (wall clock for the whole pipeline) into store / trunk / cool-down /
                 evaluation from those rates, and print the plan.
4. **store**     a feature store (``store.FeatureStore``: tapped layers + top-k labels) over (a) the target's
                 own greedy responses to ShareGPT first turns and, for ``code_share`` of the prompts, to
                 completions of documented standard-library functions (``regenerate``; chat template, or plain text
                 continuations for a base model without one) and (b) a prefill over other ShareGPT exchanges.
5. **trunk**     a head sized from the target's config, its layers started as copies of the target's last
                 layers (``Trainer.initialize_layers_from_target``; fresh where the target's layers do not fit
                 a head layer, e.g. Gemma's extra norms), trained at a constant rate (``lr_schedule="wsd"``).
6. **cool-down** a copy of the trunk's checkpoint, its rate decayed to 0 (``1 - sqrt``) over the last steps.
7. **export**    a Hub-ready head folder (bf16 safetensors, remote code, ``training_recipe.json``).
8. **evaluate**  held-out τ (MT-Bench and HumanEval prompts, never in the training data) of the head alone and
                 of the default loop, and the speedup of both and of prompt lookup over plain greedy decoding;
                 written into the head's model card (``README.md``).
9. **push**      with ``--push REPO``, through ``hub.push_head``.

The modules: ``recipe.py`` (settings, the target checks, the run's state), ``plan.py`` (the budget's plan and the
progress display), ``pipeline.py`` (the phases and ``distill``), ``evaluation.py`` (held-out τ, speed and the card).

Everything lives in ``--output``: ``distill.json`` (what the run is, its rates, plan, finished phases and
results), ``regenerated.jsonl``, ``store/``, ``trunk/`` and ``cool_<step>/`` (trainer checkpoints) and
``head/``. Each phase resumes where it stopped, so a killed run, run again with the same arguments, continues;
a second call with a larger ``--budget`` continues the same run: the store grows to what a first call with that
budget would build (``plan.plan_for_budget``), the trunk trains on from its checkpoint over the grown store, and a
new cool-down, export and evaluation follow. Precision (bf16 where this machine is fast at it), threads and
device (a GPU through accelerate's ``Accelerator`` when there is one) are chosen here.
"""

from .evaluation import heldout_evaluation
from .pipeline import cmd_distill, distill, register
from .plan import Display, make_plan
from .recipe import DistillError, DistillRecipe, DistillSettings, RunState, check_target_model, parse_budget

__all__ = ["Display", "DistillError", "DistillRecipe", "DistillSettings", "RunState", "check_target_model",
           "cmd_distill", "distill", "heldout_evaluation", "make_plan", "parse_budget", "register"]
