"""Is the tree planner's acceptance estimate right for every node it may buy?

    python benchmarks/tree_calibration.py [--prompts 6] [--new-tokens 128] [--nodes 15]

fp32 greedy decoding of MT-Bench and HumanEval prompts with the committed head, every round a plain step
plus one draft (so every generated position is drafted once). Each draft's likeliest continuations are
ranked as the loop ranks them (``rank_continuations``); the greedy text says which were accepted. The
planner predicts a node's acceptance as its path probability times a rate for its depth (accepted over
predicted, per depth: ``AdaptiveVerifyPolicy.observe_tree``). Per node rank, this prints the mean path
probability, the depth-calibrated prediction (rates fitted on the same rounds, so the total is exact by
construction) and the acceptance observed. Where the low ranks come out below their prediction, the
planner over-buys width. No time is measured. Writes benchmarks/results/tree_calibration.{json,md}.
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
from hf_dflash2.draft_tree import rank_continuations  # noqa: E402


def node_outcomes(nodes, truth: torch.Tensor) -> torch.Tensor:
    """nodes: HeadNodes of one row; truth [S] the greedy continuation -> [M] bool, each node's path matches."""
    ok = []
    for r in range(nodes.tokens.shape[1]):
        depth, parent = int(nodes.depth[0, r]), int(nodes.parent[0, r])
        match = int(nodes.tokens[0, r]) == int(truth[depth - 1])
        ok.append(match and (parent < 0 or ok[parent]))
    return torch.tensor(ok)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--nodes", type=int, default=15)
    args = parser.parse_args()
    target, tokenizer, head = fp32_committed_head()
    rows = []
    for name in ("mtbench", "humaneval"):
        drafts = []

        def record(anchor_pos, out):
            nodes = rank_continuations(head, out, args.nodes)
            drafts.append((anchor_pos, nodes))

        probs, depths, accepted = [], [], []
        for prompt in tqdm(load_prompt_set(name, args.prompts), desc=name, unit="prompt"):
            drafts.clear()
            text = torch.tensor(drafting_every_position(target, tokenizer, head, prompt, args.new_tokens, record))
            for anchor_pos, nodes in drafts:
                deepest = int(nodes.depth.max())
                if anchor_pos + deepest < len(text):
                    probs.append(nodes.logp[0].float().exp())
                    depths.append(nodes.depth[0])
                    accepted.append(node_outcomes(nodes, text[anchor_pos + 1: anchor_pos + 1 + deepest]))
        prob, depth, ok = torch.stack(probs), torch.stack(depths), torch.stack(accepted).float()
        rate = torch.zeros(int(depth.max()) + 1)
        for d in range(1, len(rate)):
            at = depth == d
            rate[d] = ok[at].sum() / prob[at].sum().clamp_min(1e-9)
        predicted = prob * rate[depth]
        for rank in range(prob.shape[1]):
            rows.append({
                "set": name, "rank": rank + 1, "rounds": prob.shape[0],
                "mean_depth": round(depth[:, rank].float().mean().item(), 2),
                "path_prob": round(prob[:, rank].mean().item(), 4),
                "predicted": round(predicted[:, rank].mean().item(), 4),
                "accepted": round(ok[:, rank].mean().item(), 4),
                "accepted_over_predicted": round(ok[:, rank].sum().item() / predicted[:, rank].sum().item(), 3),
            })
    columns = list(rows[0])
    print(table(rows, columns))
    command = "python benchmarks/tree_calibration.py " + " ".join(sys.argv[1:])
    save("tree_calibration", {"command": command, "rows": rows})
    note = ("Per node rank of the head's ranked continuations (fp32 greedy, committed head): path probability, "
            "the depth-calibrated prediction the planner would make, and the acceptance observed.")
    (RESULTS / "tree_calibration.md").write_text(note + "\n\n" + table(rows, columns) + f"\n\nCommand: `{command}`\n")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
