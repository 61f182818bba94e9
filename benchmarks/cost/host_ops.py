"""The host work of a round: tensor operations the default loop runs outside the target's forward and the
head's draft pass, per round and by phase, against those plain ``generate`` runs around each forward.

    python benchmarks/cost/host_ops.py [--set mtbench] [--prompts 2] [--tokens 64] [--dtype bf16]

On a CPU every small tensor operation costs the host a few microseconds, whatever its size, and the bound the
bench prints (tau / (c_d x drafted share + v)) counts the forwards only, so this is the share of a round the
loop can lose to it. Operation counts do not depend on how busy the machine is, which is why they are the
measure here: under ``torch.profiler``, each top-level ATen operation (one not called by another) is counted
in the loop's phase (its ``record_function`` names, ``dflash2::plan`` etc.) it ran in; those inside the target's
forward (the same for both sides) and inside the draft pass are left out. Two runs of the loop: the default
policy (SmolLM2-135M-Instruct and the committed head, draft rounds and plain rounds as they come) and every round
forced to a plain step (``ForcedVerifyLengths([0])``); plain ``generate`` on the fastest plain configuration
(``ar_packed``) beside them. Writes benchmarks/results/<cpu kind>/host_ops_<set>.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, machine, results_dir, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set, load_target  # noqa: E402
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths  # noqa: E402
from hf_dflash2.evaluation.bench import plain_configuration  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402

TARGET_FORWARD, DRAFT_PASS = "host_ops::target_forward", "host_ops::draft_pass"


def labelled(function, name: str):
    def wrapper(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)

    return wrapper


def count_host_ops(events) -> collections.Counter:
    """Top-level ATen operations by the innermost loop phase around them (``other``: in none), leaving out
    those inside the target's forward or the draft pass."""
    counts = collections.Counter()
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        phase, parent, nested = "other", event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name in (TARGET_FORWARD, DRAFT_PASS):
                nested = True
                break
            if parent.name.startswith("dflash2::") and phase == "other":
                phase = parent.name.removeprefix("dflash2::")
            parent = parent.cpu_parent
        if not nested:
            counts[phase] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="mtbench", choices=("humaneval", "mtbench", "longctx"))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    args = parser.parse_args()
    if args.prompts < 1 or args.tokens < 2:
        parser.error(f"--prompts {args.prompts} must be >= 1 and --tokens {args.tokens} >= 2")
    torch.set_num_threads(2)
    target, tokenizer = load_target(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    head = load_head(default_head(), target)
    target.forward = labelled(target.forward, TARGET_FORWARD)
    head.draft_block = labelled(head.draft_block, DRAFT_PASS)
    prompts = [encode_prompt(tokenizer, p) for p in load_prompt_set(args.set, args.prompts)]
    common = dict(max_new_tokens=args.tokens, pad_token_id=tokenizer.pad_token_id, **GREEDY)

    def loop(policy=None):
        extra = {} if policy is None else {"verify_policy": policy}
        results = [speculative_generate(target, head, ids, **common, **extra) for ids in prompts]
        return sum(r.stats.verify_forwards for r in results), sum(r.stats.draft_passes for r in results)

    def plain():
        with plain_configuration(target, "ar_packed", 1):
            outputs = [target.generate(ids, attention_mask=torch.ones_like(ids), **common) for ids in prompts]
        return sum(out.shape[1] - ids.shape[1] for out, ids in zip(outputs, prompts)), 0

    runs = {"loop, default policy": loop, "loop, plain steps only": lambda: loop(ForcedVerifyLengths([0])),
            "plain generate (ar_packed)": plain}
    rows, phases_seen = [], []
    with torch.no_grad():
        for name, run in runs.items():
            run()  # warm-up: kernels probed, cost model cached
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                rounds, draft_passes = run()
            counts = count_host_ops(prof.events())
            phases_seen += [p for p in counts if p not in phases_seen]
            row = {"run": name, "rounds": rounds, "draft_passes": draft_passes,
                   "host_ops_per_round": round(sum(counts.values()) / rounds, 1)}
            row.update({phase: round(n / rounds, 1) for phase, n in counts.items()})
            rows.append(row)
            print(row, flush=True)
    columns = ["run", "rounds", "draft_passes", "host_ops_per_round", *phases_seen]
    for row in rows:
        for phase in phases_seen:
            row.setdefault(phase, 0.0)
    header = (f"Tensor operations on the host per round (a plain `generate` step counts as one), outside the target's "
              f"forward and the draft pass: SmolLM2-135M-Instruct with the committed head, {args.set} (first "
              f"{args.prompts}), {args.tokens} new tokens, greedy, {args.dtype}, {torch.get_num_threads()} threads. "
              "Phase columns: the loop's `record_function` phases; other: outside every phase (for `generate`, "
              "all of its own work between forwards).")
    text = f"{header}\n\n{table(rows, columns)}\n"
    print(text)
    stem = f"host_ops_{args.set}"
    (results_dir() / f"{stem}.md").write_text(text)
    command = "python benchmarks/cost/host_ops.py " + " ".join(sys.argv[1:])
    print(f"written {save(stem, {'command': command, 'header': header, 'machine': machine(), 'rows': rows})}")


if __name__ == "__main__":
    main()
