"""The held-out evaluation a distilled head's card shows: τ and speedup of the head alone, the default loop and
prompt lookup over the fastest plain greedy ``generate``, on prompts never trained on."""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import torch

from ...evaluation.bench import BASELINE_METHODS, Runner, fastest_baseline, seconds_per_token, warm_up
from ...hub import METHOD_NOTES, render_model_card
from ..regenerate import encode_prompts

CARD_DATASETS = ["anon8231489123/ShareGPT_Vicuna_unfiltered"]


# The card's keys for the bench methods the evaluation runs after the plain baselines.
CARD_METHODS = {"dflash2_fixed_block": "head", "dflash2_fast": "default", "prompt_lookup": "prompt_lookup"}


@torch.no_grad()
def heldout_evaluation(target, tokenizer, head, prompts: list[dict], max_new_tokens: int, on_prompt=None) -> dict:
    """Per prompt set (HumanEval, MT-Bench), on prompts never trained on, greedy, batch 1, methods interleaved per
    prompt, each run by the bench's ``Runner``: plain greedy ``generate`` on the bench's plain configurations
    (``BASELINE_METHODS``; the fastest on a set is the baseline, ``fastest_baseline``), the head alone
    (``dflash2_fixed_block``: every round verifies its block), ``speculative_generate``'s default loop
    (``dflash2_fast``) and prompt lookup. -> per set: τ, per-position acceptance, tokens/s and speedup over the
    baseline (ratio of the median seconds per token over prompts) under the card's keys (``CARD_METHODS``), and
    on how many prompts the default loop's text equals plain greedy's."""
    device = next(target.parameters()).device
    runner = Runner(target, tokenizer, {"dflash2": head}, max_new_tokens, temperature=0.0)
    baselines = tuple(m for m in BASELINE_METHODS if runner.supports(m, 1) is None)
    methods = (*baselines, *CARD_METHODS)
    encoded = encode_prompts(tokenizer, prompts, 1024)
    if encoded:  # first-call costs (the default loop measures its cost model once per machine)
        ids = torch.tensor([encoded[0][1]], device=device)
        warm_up(runner, methods, ids, torch.ones_like(ids))
    per_set: dict[str, dict] = {}
    for index, (prompt_id, prompt_ids) in enumerate(encoded):
        name = "humaneval" if prompt_id.startswith("HumanEval") else "mtbench"
        entry = per_set.setdefault(name, {m: {"seconds": [], "tokens": [], "stats": None} for m in methods})
        entry.setdefault("same_text", [0, 0])
        ids = torch.tensor([prompt_ids], device=device)
        texts = {}
        for shift in range(len(methods)):  # rotated: no method always runs right after the same other one
            method = methods[(index + shift) % len(methods)]
            generated, seconds, stats, method_texts = runner.run(method, ids, torch.ones_like(ids))
            texts[method] = method_texts[0]
            record = entry[method]
            record["seconds"].append(seconds)
            record["tokens"].append(generated)
            if stats is not None:
                record["stats"] = copy.deepcopy(stats) if record["stats"] is None else record["stats"].merge(stats)
        entry["same_text"][0] += texts["dflash2_fast"] == texts["ar"]
        entry["same_text"][1] += 1
        if on_prompt is not None:
            on_prompt((index + 1) / len(encoded))
    results = {}
    for name, entry in per_set.items():
        fastest = fastest_baseline({m: entry[m] for m in baselines})
        baseline = statistics.median(seconds_per_token(entry[fastest]))
        as_loaded = statistics.median(seconds_per_token(entry["ar"]))
        row = {"greedy_tokens_per_s": round(1 / baseline, 2), "baseline": fastest, "baselines": list(baselines),
               "prompts": entry["same_text"][1],
               **({"greedy_as_loaded_tokens_per_s": round(1 / as_loaded, 2)} if len(baselines) > 1 else {})}
        for method, key in CARD_METHODS.items():
            record = entry[method]
            median = statistics.median(seconds_per_token(record))
            row[key] = {"speedup": round(baseline / median, 3), "tokens_per_s": round(1 / median, 2)}
            if record["stats"] is not None:
                row[key]["tau"] = round(record["stats"].acceptance_length, 3)
                row[key]["per_position_acceptance"] = [round(x, 3) for x in
                                                       record["stats"].per_position_acceptance[:8]]
        row["default"]["same_text_as_greedy"] = f"{entry['same_text'][0]}/{entry['same_text'][1]}"
        results[name] = row
    return results


def card_results(evaluation: dict, details: dict) -> dict:
    """The model card's results block (``hub.render_model_card``): the head alone as the main method, the
    default loop as ``with_ngram_drafts``."""
    sets = evaluation["sets"]
    timed = next((row["baselines"] for row in sets.values() if "baselines" in row), None)  # older runs: none
    return {
        "method": "dflash2_fixed_block",
        **({"baselines": timed} if timed is not None else {}),
        "method_note": METHOD_NOTES["dflash2_fixed_block"] + "; speedup over the fastest plain greedy `generate`",
        "datasets": {name: {"tau": row["head"].get("tau"), "speedup": row["head"]["speedup"],
                            "per_position_acceptance": row["head"].get("per_position_acceptance", [])}
                     for name, row in sets.items()},
        "with_ngram_drafts": {name: {"tau": row["default"].get("tau"), "speedup": row["default"]["speedup"]}
                              for name, row in sets.items()},
        "train_datasets": CARD_DATASETS,
        **details,
        "temperature": 0,
    }


def card_extra(evaluation: dict) -> str:
    """A section the card template has no slot for: prompt lookup and the baseline, per set."""
    lines = ["## Held-out evaluation (hf-dflash2 distill)", "",
             f"Greedy, batch 1, {evaluation['max_new_tokens']} new tokens per prompt, {evaluation['prompts']} prompts "
             "(HumanEval and MT-Bench, never in the training data). Baseline: "
             f"{evaluation['baseline']}; per set the fastest plain `generate`: as loaded (`ar`), with oneDNN "
             "linears (`ar_onednn`) where this CPU has oneDNN, and on the packed grouped-query attention "
             "(`ar_packed`) where the target has grouped-query attention.", "",
             "| set | greedy tok/s | head alone τ / speedup | default loop τ / speedup | prompt lookup speedup | "
             "default loop text = greedy |", "|---|---|---|---|---|---|"]
    for name, row in evaluation["sets"].items():
        lines.append(f"| {name} | {row['greedy_tokens_per_s']:.1f} ({row['baseline']}) | "
                     f"{row['head'].get('tau', 0):.2f} / "
                     f"{row['head']['speedup']:.2f}× | {row['default'].get('tau', 0):.2f} / "
                     f"{row['default']['speedup']:.2f}× | {row['prompt_lookup']['speedup']:.2f}× | "
                     f"{row['default']['same_text_as_greedy']} |")
    return "\n".join(lines) + "\n"


def write_card(head_folder: Path, repo_id: str, results: dict, extra: str) -> None:
    card = render_model_card(head_folder, repo_id, results=results)
    (head_folder / "README.md").write_text(card.rstrip() + "\n\n" + extra, encoding="utf-8")
