"""What each kind of round costs and commits against what the adaptive policy expected: the default loop's
plain steps, rounds the head drafted and rounds that verified n-gram drafts alone.

    python benchmarks/speed/round_kinds.py [--sets humaneval,mtbench] [--batch-size 8] [--dtype bf16]
                                           [--tokens 96] [--calls 3]

The sets run one after another in one process (a set inherits what the policy learnt on the one before, as in
the bench, where both are timed with the same cost model); each set runs one call to warm up, then ``--calls``
calls whose rounds are recorded. Per kind: rounds, median milliseconds measured and as the cost model predicts
them (the policy's ``rho`` is their ratio), tokens committed per round and as the policy expected (for the plan
it chose, before the loop caps it at the token budget's room, so the last rounds of a call overstate it), and
tokens committed per plain step's time (a kind pays when this beats the plain steps' own; rows that finished
make later steps commit fewer). The first round of each call is left out, as the policy leaves it out. It
reads each round's committed tokens on the host (free on a CPU; on CUDA that read would sync every round).
Writes benchmarks/results/<cpu kind>/round_kinds_<dtype>_b<B>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, results_dir, save, table  # noqa: E402

import hf_dflash2.cost_model_dflash2 as cost_model  # noqa: E402
from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set, load_target  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, left_pad, load_head  # noqa: E402
from hf_dflash2.speculative_dflash2 import SpeculativeStats  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--sets", default="humaneval,mtbench")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
parser.add_argument("--tokens", type=int, default=96, help="new tokens per row")
parser.add_argument("--calls", type=int, default=3, help="recorded calls per set, after one to warm up")
args = parser.parse_args()
sets = args.sets.split(",")
unknown = [name for name in sets if name not in ("humaneval", "mtbench", "longctx")]
if unknown or args.batch_size < 1 or args.tokens < 2 or args.calls < 1:
    parser.error(f"--sets {args.sets} (of humaneval, mtbench, longctx), --batch-size {args.batch_size}, --tokens "
                 f"{args.tokens} (>= 2) and --calls {args.calls} (>= 1)")


class RecordedPolicy(cost_model.AdaptiveVerifyPolicy):
    """The default policy, noting each round's plan (expected tokens) and its measured and predicted time."""

    rounds: list[dict] = []  # shared by every call's policy
    _expected = None

    def _best_plan(self, expected, size, rows, drafted):
        plan = super()._best_plan(expected, size, rows, drafted)
        self._expected = expected[plan]
        return plan

    def _time_last_round(self):
        now = time.perf_counter()
        if self._round is not None and self._round_started is not None and self._rounds_timed >= 1:
            kind, k = self._round
            predicted = self.cost.verify(k + 1) + (self.cost.draft_seconds if kind == "draft" else 0.0)
            RecordedPolicy.rounds.append({"kind": kind if kind != "draft" or k else "draft, none verified",
                                          "seconds": now - self._round_started, "predicted": predicted,
                                          "expected": self._last_expected, "committed": self._last_committed})
        self._last_expected = None
        super()._time_last_round()

    def chosen(self, k, head_used=True):
        self._last_expected = float(self._expected) if k > 0 and self._expected is not None else None
        super().chosen(k, head_used)


committed_by_round = [0]
record = SpeculativeStats.record


def record_committed(self, accepted, committed, active=None, verified=None, source=None, tree=False):
    weight = torch.ones_like(accepted) if active is None else active.long()
    committed_by_round[0] = int((committed.long() * weight).sum())
    return record(self, accepted, committed, active, verified, source, tree)


SpeculativeStats.record = record_committed
RecordedPolicy._last_expected = None
RecordedPolicy._last_committed = property(lambda self: committed_by_round[0])
cost_model.AdaptiveVerifyPolicy = RecordedPolicy  # what verify_policy_for builds

torch.set_num_threads(2)
dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
target, tokenizer = load_target(dtype=dtype)
head = load_head(default_head(), target)
rows = []
for name in sets:
    prompts = load_prompt_set(name, args.batch_size)
    ids, mask = left_pad([encode_prompt(tokenizer, p) for p in prompts], tokenizer.pad_token_id)
    for call in range(args.calls + 1):
        RecordedPolicy.rounds.clear()
        speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=args.tokens,
                             pad_token_id=tokenizer.pad_token_id, **GREEDY)
        if call == 0:
            continue
        by_kind = defaultdict(list)
        for entry in RecordedPolicy.rounds:
            by_kind[entry["kind"]].append(entry)
        step = statistics.median(e["seconds"] for e in by_kind["step"]) if by_kind["step"] else None
        for kind, entries in sorted(by_kind.items()):
            seconds = sum(e["seconds"] for e in entries)
            expected = [e["expected"] for e in entries if e["expected"] is not None]
            rows.append({
                "set": name, "call": call, "kind": kind, "rounds": len(entries),
                "measured ms": 1000 * statistics.median(e["seconds"] for e in entries),
                "predicted ms": 1000 * statistics.median(e["predicted"] for e in entries),
                "tokens a round": sum(e["committed"] for e in entries) / len(entries),
                "expected tokens": sum(expected) / len(expected) if expected else None,
                "tokens a step's time": None if step is None else sum(e["committed"] for e in entries) / seconds * step,
            })
columns = ["set", "call", "kind", "rounds", "measured ms", "predicted ms", "tokens a round", "expected tokens",
           "tokens a step's time"]
command = "python benchmarks/speed/round_kinds.py " + " ".join(sys.argv[1:])
text = (f"`{command}` (SmolLM2-135M-Instruct {args.dtype}, batch {args.batch_size}, the committed head, the "
        f"default loop)\n\n{table(rows, columns)}\n")
print(text)
stem = f"round_kinds_{args.dtype}_b{args.batch_size}"
save(stem, {"command": command, "rows": rows})
(results_dir() / f"{stem}.md").write_text(text)
