"""Which tree of the head's candidates should a round verify? Acceptance of tree shapes at equal size.

    python benchmarks/speed/tree_shapes.py [--prompts 6] [--new-tokens 128] [--heads DIR,DIR] [--output NAME]

fp32 greedy decoding of MT-Bench and HumanEval prompts with each head (default: the committed head), every
round a plain step plus one draft, so every generated position is drafted once; the greedy text says
which tokens a round's tree would have had accepted. For trees of M drafted nodes (M = 4, 7, 11, 15) built from the
head's top-16 candidates per position, the mean tokens a round commits (1 + the deepest accepted node):

- ``chain``: the selector's path, its first min(M, S) tokens (what a linear round verifies);
- ``chain + runner-ups``: the chain's first kh tokens and M - kh of the next likeliest first tokens
  (the loop's tree without its n-gram branch), the split best on average for that set (an upper bound
  for any fixed rule);
- ``unary best-first``: the M nodes of highest path probability when each position's candidates are
  taken as independent (the unary softmax; what a DFlash-1 head can rank);
- ``selector best-first``: the same with the selector's K x K scores as a Markov chain over the
  candidates (``P(b | a) = softmax(S_t(a, .))``): dFlash 2's pairwise scores rank deeper branches;
- ``selector x top-K mass``: the selector's step probabilities times the unary probability its K
  candidates hold at that depth (the selector's softmax ignores the mass outside them).

A DFlash-1 head has no selector: its chain is each position's argmax, its candidates the unary top 16,
and its selector column is empty. Given a dFlash 2 head and a DFlash-1 head trained at equal budget, the
two best-first columns are the ablation in trees (the pair of recipes/smollm2-135m-dflash1.yaml).

No time is measured. Writes benchmarks/results/<cpu kind>/<output, default tree_shapes>.{json,md}.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import drafting_every_position, fp32_committed_head, results_dir, save, table  # noqa: E402

from hf_dflash2.assets import load_prompt_set  # noqa: E402
from hf_dflash2.generation.trees import TREE_TOP_K  # noqa: E402

SIZES = (4, 7, 11, 15)


def best_first(size: int, depth_count: int, step_probs) -> list[tuple[int, int, int]]:
    """The ``size`` nodes of highest path probability -> [(depth, candidate, parent node index)], parents
    first. ``step_probs(depth, parent_candidate)`` -> probabilities of the K candidates at ``depth``
    (parent_candidate None at depth 0)."""
    nodes: list[tuple[int, int, int]] = []
    frontier = [(-float(p), 0, j, -1) for j, p in enumerate(step_probs(0, None))]
    heapq.heapify(frontier)
    probs = []
    while frontier and len(nodes) < size:
        neg, depth, candidate, parent = heapq.heappop(frontier)
        nodes.append((depth, candidate, parent))
        probs.append(-neg)
        if depth + 1 < depth_count:
            index = len(nodes) - 1
            for j, p in enumerate(step_probs(depth + 1, candidate)):
                heapq.heappush(frontier, (neg * float(p), depth + 1, j, index))
    return nodes


def committed(nodes, candidates: list[list[int]], truth: list[int]) -> int:
    """1 + the deepest node whose path matches ``truth`` (candidates[d][j]: token of candidate j at d)."""
    ok = []
    best = 0
    for depth, candidate, parent in nodes:
        good = candidates[depth][candidate] == truth[depth] and (parent < 0 or ok[parent])
        ok.append(good)
        if good:
            best = max(best, depth + 1)
    return 1 + best


def chain_nodes(path: list[int], length: int) -> list[tuple[int, int, int]]:
    return [(d, path[d], d - 1) for d in range(min(length, len(path)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--heads", default=None, help="comma-separated head directories (default: the committed head)")
    parser.add_argument("--output", default="tree_shapes", help="results name under benchmarks/results/<cpu kind>/")
    args = parser.parse_args()
    if Path(args.output).name != args.output:
        parser.error(f"--output is a name under benchmarks/results/<cpu kind>/, not a path: {args.output!r}")
    from hf_dflash2.prompts import load_head

    target, tokenizer, committed_head = fp32_committed_head(load_committed=args.heads is None)
    heads = {"committed": committed_head} if args.heads is None else {
        path: load_head(path, target) for path in args.heads.split(",")}
    rows = []
    for head_name, head in heads.items():
        rows += shapes_of(head_name, head, target, tokenizer, args.prompts, args.new_tokens)
    columns = list(rows[0])
    print(table(rows, columns))
    command = "python benchmarks/speed/tree_shapes.py " + " ".join(sys.argv[1:])
    save(args.output, {"command": command, "rows": rows})
    note = ("Mean tokens a round commits (1 + deepest accepted node) for trees of the head's candidates, "
            "fp32 greedy; no n-gram branch.")
    text = note + "\n\n" + table(rows, columns) + f"\n\nCommand: `{command}`\n"
    (results_dir() / f"{args.output}.md").write_text(text)


def shapes_of(head_name: str, head, target, tokenizer, prompts: int, new_tokens: int) -> list[dict]:
    """One row per (prompt set, tree size) for one head."""
    rounds_seen = []

    def record(anchor_pos, out):
        # the draft's own candidates and pair scores (``DraftOutput.pair_scores``), as the loop's trees use them
        unary = out.logits[0].float().softmax(-1)  # [S, V'] over the draft vocabulary
        if out.pair_scores is not None:
            top = unary.topk(out.q_ids.shape[-1], dim=-1)
            candidates = out.q_ids[0]  # [S, K] by unary score, as the selector ranks
            path = (out.q_ids[0] == out.tokens[0][:, None]).int().argmax(-1).tolist()  # the chosen candidates
            transitions = out.pair_scores[0].float().softmax(-1).tolist()  # [S, K, K]
        else:  # DFlash-1: the argmax chain, the unary top-k as candidates (as the loop ranks them)
            top = unary.topk(TREE_TOP_K, dim=-1)
            candidates = top.indices if head.draft_vocab is None else head.draft_vocab[top.indices]
            path = [0] * unary.shape[0]
            transitions = None
        rounds_seen.append({"anchor_pos": anchor_pos, "path": path, "candidates": candidates.tolist(),
                            "unary": top.values.tolist(), "mass": top.values.sum(-1).tolist(),
                            "transitions": transitions})

    rows = []
    for name in ("mtbench", "humaneval"):
        records = []
        for prompt in tqdm(load_prompt_set(name, prompts), desc=f"{head_name} {name}", unit="prompt"):
            rounds_seen.clear()
            text = drafting_every_position(target, tokenizer, head, prompt, new_tokens, record)
            for r in rounds_seen:
                depth_count = len(r["path"])
                if r["anchor_pos"] + depth_count < len(text):
                    r["truth"] = text[r["anchor_pos"] + 1 : r["anchor_pos"] + 1 + depth_count]
                    records.append(dict(r))
        for size in SIZES:
            scores = {"chain": [], "unary best-first": [], "selector best-first": [], "selector x top-K mass": []}
            splits = {kh: [] for kh in range(0, min(size, 7) + 1) if size - kh <= 15}
            for r in records:
                cands, truth, depth_count = r["candidates"], r["truth"], len(r["path"])
                scores["chain"].append(committed(chain_nodes(r["path"], size), cands, truth))
                for kh in splits:
                    runner_ups = [j for j in range(len(cands[0])) if j != r["path"][0]][: size - kh]
                    nodes = chain_nodes(r["path"], kh) + [(0, j, -1) for j in runner_ups]
                    splits[kh].append(committed(nodes, cands, truth))
                unary = best_first(size, depth_count, lambda d, _parent, u=r["unary"]: u[d])
                scores["unary best-first"].append(committed(unary, cands, truth))
                trans = r["transitions"]
                if trans is not None:
                    markov = best_first(size, depth_count,
                                        lambda d, parent, t=trans: t[d][0 if parent is None else parent])
                    scores["selector best-first"].append(committed(markov, cands, truth))
                    # the selector's softmax is over the K candidates only: weigh each depth by the unary mass
                    # its K candidates hold, so that a depth the head is unsure of ranks lower
                    weighted = best_first(size, depth_count, lambda d, parent, t=trans, m=r["mass"]: [
                        p * m[d] for p in t[d][0 if parent is None else parent]])
                    scores["selector x top-K mass"].append(committed(weighted, cands, truth))
            best_kh = max(splits, key=lambda kh: sum(splits[kh]))
            row = {"head": head_name, "set": name, "tree_size": size, "rounds": len(records)}
            row["chain"] = round(sum(scores["chain"]) / len(records), 3)
            row["chain + runner-ups (best split)"] = round(sum(splits[best_kh]) / len(records), 3)
            row["best kh"] = best_kh
            row["unary best-first"] = round(sum(scores["unary best-first"]) / len(records), 3)
            selector = scores["selector best-first"]
            row["selector best-first"] = round(sum(selector) / len(records), 3) if selector else None
            weighted = scores["selector x top-K mass"]
            row["selector x top-K mass"] = round(sum(weighted) / len(records), 3) if weighted else None
            rows.append(row)
    return rows


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
