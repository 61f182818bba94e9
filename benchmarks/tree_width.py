"""What does a tree round of m head nodes cost at the real context, and what does it commit?

    python benchmarks/tree_width.py [--dtype auto] [--prompts 4] [--new-tokens 192] [--widths 0,1,3,7,11,15]

Greedy decoding of MT-Bench and HumanEval prompts with the committed head, n-gram drafts off, where the
rounds rotate through fixed plans: ``step`` (a plain AR step, no draft pass) and trees of m of the head's
likeliest continuations (m = 0: the draft pass and a step). Every plan thus runs at the same contexts,
interleaved, so drift and context length hit them alike. Per plan: median seconds per round, mean tokens
committed per round, tokens per second, and the cost model's prediction (``verify(m + 1) + draft``, the
cache the loop uses, measured at 256 tokens of context) as a ratio to its step, next to the measured one.
If the measured ratio grows with m faster than the predicted one, the planner, which scales every drafted
round by one measured factor (``rho``), prices wide trees too cheaply.

A second table times the verify forward alone (``--kernel``) for k new tokens after 256 and 1,024 tokens
of context, as the cost model runs it (no mask), as a linear round runs it (a 2-D padding mask) and as a
tree round runs it (a 4-D boolean mask), to tell a context effect from a mask effect.

A round's time runs from one ``wants_draft`` to the next (as the policy's own clock), so a tree path moved
in the KV cache is charged to the round after it; rounds are counted through a streamer (one more host
read per round, for every plan alike). Writes benchmarks/results/tree_width.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, interleaved, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set  # noqa: E402
from hf_dflash2.charts import save_chart  # noqa: E402
from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, load_or_measure_cost_model  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import apply_chat_template_option, default_head, encode_prompt, load_head  # noqa: E402

BLOCK = 16  # the default loop's block with n-gram drafts on: trees of up to 15 nodes


class RotatingPlans(AdaptiveVerifyPolicy):
    """Rounds rotate through ``plans`` ("step" or a node count m), whatever they are expected to commit;
    each round's seconds and plan are logged (``log``)."""

    def __init__(self, cost, plans):
        super().__init__(cost, clock=None)
        self.plans, self.turn, self.log, self._started, self._plan = plans, 0, [], None, None

    def wants_draft(self) -> bool:
        now = time.perf_counter()
        if self._plan is not None:
            self.log.append((self._plan, now - self._started))
        self._plan, self._started = self.plans[self.turn % len(self.plans)], now
        self.turn += 1
        return self._plan != "step"

    def wants_ngram(self) -> bool:
        return False

    def choose_tree(self, node_logp, node_depth, ngram_size, spells_ngram):
        return torch.tensor([min(self._plan, node_logp.shape[1]), 0])

    def chosen(self, k: int, head_used: bool = True) -> None:
        pass


class RoundCounter:
    """A streamer that keeps how many tokens each put carried (the prompt, the first token, then one put
    per round)."""

    def __init__(self):
        self.committed = []

    def put(self, tokens) -> None:
        self.committed.append(tokens.numel())

    def end(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--widths", default="0,1,3,7,11,15", help="tree sizes m to rotate through, with plain steps")
    parser.add_argument("--kernel", action="store_true", help="also time the verify forward alone")
    args = parser.parse_args()
    target, tokenizer = load_target_for_decoding(args.dtype)
    apply_chat_template_option(tokenizer, "auto")
    dtype = next(target.parameters()).dtype
    head = load_head(default_head("smollm2-135m-dflash2"), target).to(dtype).bind_target(target)
    cost = load_or_measure_cost_model(target, head, 1, BLOCK)
    plans = ["step", *(int(m) for m in args.widths.split(","))]

    rows = []
    for name in ("mtbench", "humaneval"):
        seconds = {p: [] for p in plans}
        tokens = {p: [] for p in plans}
        contexts = []
        for prompt in tqdm(load_prompt_set(name, args.prompts), desc=name, unit="prompt"):
            ids = encode_prompt(tokenizer, prompt, target.device)
            policy = RotatingPlans(cost, plans)
            counter = RoundCounter()
            out = speculative_generate(target, head, ids, max_new_tokens=args.new_tokens, ngram_size=0,
                                       block_size=BLOCK, verify_policy=policy, streamer=counter)
            contexts.append(ids.shape[1] + int(out.num_generated[0]) // 2)
            # the last round is not timed (no later wants_draft); the first pays one-off set-up
            for (plan, secs), count in list(zip(policy.log, counter.committed[2:]))[1:]:
                seconds[plan].append(secs)
                tokens[plan].append(count)
        step = statistics.median(seconds["step"])
        for plan in plans:
            if not seconds[plan]:
                continue
            secs = statistics.median(seconds[plan])
            per_round = sum(tokens[plan]) / len(tokens[plan])
            predicted = cost.verify(1) if plan == "step" else cost.verify(plan + 1) + cost.draft_seconds
            rows.append({
                "set": name, "plan": "step" if plan == "step" else f"m={plan}", "rounds": len(seconds[plan]),
                "ms_per_round": round(secs * 1000, 2), "tokens_per_round": round(per_round, 3),
                "tokens_per_s": round(per_round / secs, 1), "cost_vs_step": round(secs / step, 3),
                "predicted_vs_step": round(predicted / cost.verify(1), 3),
                "mid_context": int(statistics.median(contexts)),
            })
    columns = list(rows[0])
    print(table(rows, columns))
    kernel = verify_kernel(target, head) if args.kernel else []
    command = "python benchmarks/tree_width.py " + " ".join(sys.argv[1:])
    save("tree_width", {"command": command, "dtype": str(dtype), "cost_model": cost.as_dict(), "rows": rows,
                        "verify_kernel": kernel})
    note = (f"Rounds rotating through fixed plans at the same contexts, {dtype}, committed head, n-gram drafts "
            "off; cost_vs_step measured, predicted_vs_step from the cached cost model (256-token context).")
    text = note + "\n\n" + table(rows, columns)
    if kernel:
        print(table(kernel, list(kernel[0])))
        text += ("\n\nThe verify forward alone, ms (median of 5), by context, mask and new tokens k:\n\n"
                 + table(kernel, list(kernel[0])))
    (RESULTS / "tree_width.md").write_text(text + f"\n\nCommand: `{command}`\n")
    chart(rows, RESULTS / "tree_width.png")


def verify_kernel(target, head, ks=(1, 4, 8, 16), contexts=(256, 1024)) -> list[dict]:
    """ms of one verify forward of k tokens after ``context`` cached tokens, per mask kind."""
    from transformers import DynamicCache

    from hf_dflash2.draft_tree import DraftTree, ancestry_of, tree_attention_mask

    device = target.device
    vocab = target.config.vocab_size
    capture = [i + 1 for i in head.config.target_layer_ids]
    rows = []
    for context in contexts:
        ids = torch.randint(0, vocab, (1, context + max(ks)), generator=torch.Generator().manual_seed(0)).to(device)
        positions = torch.arange(context + max(ks), device=device)[None]
        cache = DynamicCache(config=target.config)
        target(input_ids=ids[:, :context], position_ids=positions[:, :context], cache=cache, use_cache=True)

        def run(k, mask_kind):
            def call():
                mask = None
                if mask_kind != "none":
                    mask = torch.ones(1, context + k, dtype=torch.long, device=device)
                if mask_kind == "tree":  # a chain as a tree: the same attention, through a 4-D mask
                    parent = (torch.arange(k, device=device) - 1).clamp_min(0)[None]
                    depth = torch.arange(k, device=device)[None]
                    tree = DraftTree(ids[:, context + 1: context + k], depth, parent, ancestry_of(parent), k - 1, 0,
                                     depth[:, 0], depth[:, 0])
                    mask = tree_attention_mask(mask.bool(), tree, target.config._attn_implementation, target.dtype)
                target(input_ids=ids[:, context: context + k], attention_mask=mask,
                       position_ids=positions[:, context: context + k], cache=cache, use_cache=True,
                       output_hidden_states=capture)
                cache.crop(-k)
            return call

        calls = {(k, kind): run(k, kind) for k in ks for kind in ("none", "linear", "tree")}
        times = interleaved(calls, repeats=5)
        for k in ks:
            rows.append({"context": context, "k": k, **{kind: round(times[(k, kind)] * 1000, 2)
                                                       for kind in ("none", "linear", "tree")}})
    return rows


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, marker in (("mtbench", "o"), ("humaneval", "s")):
        mine = [r for r in rows if r["set"] == name and r["plan"] != "step"]
        widths = [int(r["plan"][2:]) for r in mine]
        axes[0].plot(widths, [r["cost_vs_step"] for r in mine], marker=marker, label=f"{name} measured")
        axes[0].plot(widths, [r["predicted_vs_step"] for r in mine], marker=marker, ls="--", label=f"{name} model")
        axes[1].plot(widths, [r["tokens_per_s"] for r in mine], marker=marker, label=name)
        step = [r for r in rows if r["set"] == name and r["plan"] == "step"]
        if step:
            axes[1].axhline(step[0]["tokens_per_s"], ls=":", color=axes[1].lines[-1].get_color())
    axes[0].set(xlabel="tree nodes m", ylabel="round cost / plain step", title="cost of a tree round")
    axes[1].set(xlabel="tree nodes m", ylabel="tokens / s", title="throughput (dotted: plain steps)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_chart(fig, path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
