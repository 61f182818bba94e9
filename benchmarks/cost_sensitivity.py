"""How much the adaptive policy's speed hangs on its cost model (session 8; round timing, session 9).

The committed head on the demo prompt, 2 HumanEval and 1 MT-Bench prompt (128 new tokens, fp32 via
``auto``), timed against plain greedy with methods rotated per repeat and prompt (median of 3): the
adaptive fast loop under two cost models that were both cached on this host ([1.13, 1.21] and
[1.03, 1.03] AR steps to verify 2 / 3 tokens), each as shipped (the call also times its own rounds)
and with round timing off (``clock=None``: the cost model alone, as in session 8), and the fixed block.
Also prints three fresh measurements of the cost model, to show its spread.

    python benchmarks/cost_sensitivity.py
"""

from __future__ import annotations

import statistics
import time

import torch

# Verify seconds for k = 1..8 new tokens and the draft pass, as the two cache entries held them.
CACHED_COSTS = {
    "cost_high": ([60.5e-3, 68.3e-3, 72.9e-3, 89.7e-3, 90.7e-3, 92.9e-3, 102.2e-3, 104.3e-3], 11.5e-3),
    "cost_low": ([65.0e-3, 66.9e-3, 66.9e-3, 88.6e-3, 90.7e-3, 92.9e-3, 102.2e-3, 104.3e-3], 11.4e-3),
}


@torch.no_grad()
def main() -> int:
    from hf_dflash2 import speculative_generate
    from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts
    from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, CostModel, measure_cost_model
    from hf_dflash2.demo import DEFAULT_PROMPT
    from hf_dflash2.precision import load_target_for_decoding
    from hf_dflash2.prompts import encode_messages, load_head

    target, tokenizer = load_target_for_decoding("auto")
    drafter = load_head("heads/smollm2-135m-dflash2", target)
    chats = [[{"role": "user", "content": DEFAULT_PROMPT}]]
    chats += [p["messages"] for p in load_humaneval_prompts()[:2]] + [p["messages"] for p in load_mtbench_prompts()[:1]]
    prompts = [torch.tensor([encode_messages(tokenizer, chat)]) for chat in chats]
    for _ in range(3):
        cost = measure_cost_model(target, drafter, 1, 8, context_length=256)
        step = cost.verify_seconds[0]
        print("fresh cost model, x AR step: verify k=1..4", [round(x / step, 2) for x in cost.verify_seconds[:4]],
              "draft", round(cost.draft_seconds / step, 2))
    methods = {"ar": None, "fixed": {"adaptive": False}}
    for name, (verify, draft) in CACHED_COSTS.items():
        methods[name] = {"cost_model": CostModel(verify, draft)}
        methods[f"{name}_untimed"] = {"verify_policy": AdaptiveVerifyPolicy(CostModel(verify, draft), clock=None)}
    names = list(methods)
    times = {m: [[] for _ in prompts] for m in names}
    taus: dict[str, list[float]] = {m: [] for m in names}
    for repeat in range(3):
        for i, ids in enumerate(prompts):
            shift = (repeat + i) % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                if name == "ar":
                    target.generate(ids, max_new_tokens=128, do_sample=False)
                else:
                    result = speculative_generate(target, drafter, ids, max_new_tokens=128, **methods[name])
                    if repeat == 0:
                        taus[name].append(round(result.stats.acceptance_length, 2))
                times[name][i].append(time.perf_counter() - started)
    for name in names:
        ratios = [statistics.median(times["ar"][i]) / statistics.median(times[name][i]) for i in range(len(prompts))]
        print(f"{name}: speed vs AR per prompt {[round(r, 2) for r in ratios]}, mean {statistics.mean(ratios):.3f}, "
              f"tau {taus[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
