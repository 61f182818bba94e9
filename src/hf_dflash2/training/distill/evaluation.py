"""The held-out evaluation a distilled head's card shows: τ and speedup of the head alone, the default loop and
prompt lookup over the fastest plain greedy ``generate``, on prompts never trained on."""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch

from ...evaluation.bench import BASELINE_METHODS, PLAIN_KERNELS, fastest_baseline, onednn_packs, seconds_per_token
from ...generation import PLAIN_GREEDY, speculative_generate
from ...hub import HEAD_ONLY_METHOD, METHOD_NOTES, render_model_card
from ...kernels_dflash2 import ForwardKernels
from ..regenerate import encode_prompts

CARD_DATASETS = ["anon8231489123/ShareGPT_Vicuna_unfiltered"]


def _generated(sequences: torch.Tensor, prompt_length: int, count: int) -> list[int]:
    return sequences[0, prompt_length : prompt_length + count].tolist()


@torch.no_grad()
def heldout_evaluation(target, tokenizer, head, prompts: list[dict], max_new_tokens: int, on_prompt=None) -> dict:
    """Per prompt set (HumanEval, MT-Bench), on prompts never trained on, greedy, batch 1, methods interleaved per
    prompt: plain greedy ``generate`` on the bench's plain configurations (``BASELINE_METHODS``: as loaded and,
    where oneDNN packs the target, on oneDNN; the faster on a set is the baseline, ``fastest_baseline``), the
    head alone (every round verifies its block, no n-gram drafts: what vLLM and SGLang serve),
    ``speculative_generate``'s default loop, and prompt lookup. -> τ, per-position acceptance, tokens/s and
    speedup over the baseline (ratio of the median seconds per token over prompts), and on how many prompts the
    default loop's text equals plain greedy's."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id
    greedy = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None, "pad_token_id": pad}

    def run(method: str, ids: torch.Tensor, tokens: int):
        started = time.perf_counter()
        stats = None
        if method in PLAIN_KERNELS:
            with ForwardKernels(target, None, 1, 1, PLAIN_KERNELS[method]):
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, **greedy)
            generated = _generated(out, ids.shape[1], out.shape[1] - ids.shape[1])
        elif method == "prompt_lookup":
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                  prompt_lookup_num_tokens=10, **greedy)
            generated = _generated(out, ids.shape[1], out.shape[1] - ids.shape[1])
        else:
            kwargs = ({"adaptive": False, "ngram_size": 0, **PLAIN_GREEDY} if method == "head"
                      else {"do_sample": False, "pad_token_id": pad})
            result = speculative_generate(target, head, ids, max_new_tokens=tokens, **kwargs)
            generated = _generated(result.sequences, ids.shape[1], int(result.num_generated[0]))
            stats = result.stats
        return generated, time.perf_counter() - started, stats

    baselines = tuple(m for m in BASELINE_METHODS if PLAIN_KERNELS[m] is None or onednn_packs(target))
    methods = (*baselines, "head", "default", "prompt_lookup")
    encoded = encode_prompts(tokenizer, prompts, 1024)
    if encoded:  # warm-up: first-call costs (the default loop measures its cost model once per machine)
        ids = torch.tensor([encoded[0][1]], device=device)
        for method in methods:
            run(method, ids, min(8, max_new_tokens))
    per_set: dict[str, dict] = {}
    for index, (prompt_id, prompt_ids) in enumerate(encoded):
        name = "humaneval" if prompt_id.startswith("HumanEval") else "mtbench"
        entry = per_set.setdefault(name, {m: {"seconds": [], "tokens": [], "stats": None} for m in methods})
        entry.setdefault("same_text", [0, 0])
        ids = torch.tensor([prompt_ids], device=device)
        texts = {}
        for shift in range(len(methods)):  # rotated: no method always runs right after the same other one
            method = methods[(index + shift) % len(methods)]
            generated, seconds, stats = run(method, ids, max_new_tokens)
            texts[method] = generated
            record = entry[method]
            record["seconds"].append(seconds)
            record["tokens"].append(len(generated))
            if stats is not None:
                record["stats"] = copy.deepcopy(stats) if record["stats"] is None else record["stats"].merge(stats)
        entry["same_text"][0] += texts["default"] == texts["ar"]
        entry["same_text"][1] += 1
        if on_prompt is not None:
            on_prompt((index + 1) / len(encoded))
    results = {}
    for name, entry in per_set.items():
        fastest = fastest_baseline({m: entry[m] for m in baselines})
        baseline = statistics.median(seconds_per_token(entry[fastest]))
        as_loaded = statistics.median(seconds_per_token(entry["ar"]))
        row = {"greedy_tokens_per_s": round(1 / baseline, 2), "baseline": fastest, "prompts": entry["same_text"][1],
               **({"greedy_as_loaded_tokens_per_s": round(1 / as_loaded, 2)} if len(baselines) > 1 else {})}
        for method in methods[len(baselines):]:
            record = entry[method]
            median = statistics.median(seconds_per_token(record))
            row[method] = {"speedup": round(baseline / median, 3), "tokens_per_s": round(1 / median, 2)}
            if record["stats"] is not None:
                row[method]["tau"] = round(record["stats"].acceptance_length, 3)
                row[method]["per_position_acceptance"] = [round(x, 3) for x in
                                                          record["stats"].per_position_acceptance[:8]]
        row["default"]["same_text_as_greedy"] = f"{entry['same_text'][0]}/{entry['same_text'][1]}"
        results[name] = row
    return results


def card_results(evaluation: dict, details: dict) -> dict:
    """The model card's results block (``hub.render_model_card``): the head alone as the main method, the
    default loop as ``with_ngram_drafts``."""
    sets = evaluation["sets"]
    return {
        "method": HEAD_ONLY_METHOD,
        "method_note": METHOD_NOTES[HEAD_ONLY_METHOD] + "; speedup over the fastest plain greedy `generate`",
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
             f"{evaluation['baseline']}; per set the faster of plain `generate` as loaded and with oneDNN "
             "linears (`ar_onednn`) where this CPU has oneDNN.", "",
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
