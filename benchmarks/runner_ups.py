"""How often the head's runner-up tokens are right where its own draft is wrong (why trees verify them).

    python benchmarks/runner_ups.py [--prompts 6] [--new-tokens 128]

fp32 greedy decoding of MT-Bench and HumanEval prompts with the committed head, every round a plain
step plus one draft, so that every generated position is drafted once. Per depth d = 1..3 of the head's
chain, among rounds whose first d - 1 drafts were right: how often the d-th draft is right, and how
often it is wrong but one of the head's next 3 / 6 likeliest tokens there (by its unary distribution)
is right, as a share of all rounds (the tokens a tree branch of runner-ups would add per round).
Writes benchmarks/results/runner_ups.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, drafting_every_position, fp32_committed_head, save, table  # noqa: E402

from hf_dflash2.assets import load_prompt_set  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, tokenizer, head = fp32_committed_head()
    drafts = []

    def record(anchor_pos, out):
        top = out.logits[0].float().topk(8, dim=-1).indices  # [S, 8] by unary probability
        ids = top if head.draft_vocab is None else head.draft_vocab.to(top.device)[top]
        drafts.append((anchor_pos, out.tokens[0].tolist(), ids.tolist()))

    rows = []
    for name in ("mtbench", "humaneval"):
        counts = {d: {"reached": 0, "right": 0, "runner_up_3": 0, "runner_up_6": 0} for d in (1, 2, 3)}
        rounds = 0
        for prompt in tqdm(load_prompt_set(name, args.prompts), desc=name, unit="prompt"):
            drafts.clear()
            text = drafting_every_position(target, tokenizer, head, prompt, args.new_tokens, record)
            for anchor_pos, tokens, candidates in drafts:
                if anchor_pos + 4 >= len(text):
                    continue
                rounds += 1
                for d in (1, 2, 3):
                    if any(tokens[j] != text[anchor_pos + 1 + j] for j in range(d - 1)):
                        break
                    truth, main = text[anchor_pos + d], tokens[d - 1]
                    runner_ups = [t for t in candidates[d - 1] if t != main]
                    c = counts[d]
                    c["reached"] += 1
                    c["right"] += main == truth
                    c["runner_up_3"] += main != truth and truth in runner_ups[:3]
                    c["runner_up_6"] += main != truth and truth in runner_ups[:6]
        for d, c in counts.items():
            rows.append({"set": name, "depth": d, "rounds_reaching_it": f"{c['reached']}/{rounds}",
                         "draft_right_given_reached": round(c["right"] / max(1, c["reached"]), 3),
                         "runner_up_3_right_per_round": round(c["runner_up_3"] / max(1, rounds), 3),
                         "runner_up_6_right_per_round": round(c["runner_up_6"] / max(1, rounds), 3)})
    columns = list(rows[0])
    print(table(rows, columns))
    command = "python benchmarks/runner_ups.py " + " ".join(sys.argv[1:])
    save("runner_ups", {"command": command, "rows": rows})
    (RESULTS / "runner_ups.md").write_text(table(rows, columns) + f"\n\nCommand: `{command}`\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
