"""Held-out tau when sampling: the head's drafts drawn from its q (speculative sampling) or fixed greedy drafts.

    python benchmarks/training/sampled_draft_tau.py [HEAD] [--prompt-slice 1] [--prompts 16] [--tokens 64] [--seeds 3]

The committed head (or HEAD) on held-out prompts (``training.commands.heldout_prompts``), the fast loop with a
fixed chain of the head's block (``adaptive=False``, no n-gram drafts, no trees), sampling at T = 1 with no
top-k or top-p, ``--seeds`` seeded runs per prompt. Four ways to draft, each lossless:

- ``q at T``: drafts drawn from the head's q at the target's temperature, kept with probability min(1, p/q)
  (the loop's chains when sampling);
- ``greedy drafts``: the head's argmax, kept with the target's probability of it (what a tree's fixed nodes
  give);
- ``q at 0.7`` / ``q at 1.5``: drafts drawn from q at another temperature.

Prints tau and the acceptance of positions 1-4 per set; writes ``results/<kind>/sampled_draft_tau.json``.
Tau only: nothing is timed, so it may run beside other work.
"""

import argparse
import copy
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import save  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.cpu.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.generation import sampling  # noqa: E402
from hf_dflash2.prompts import default_head, load_head  # noqa: E402
from hf_dflash2.training.commands import heldout_prompts  # noqa: E402
from hf_dflash2.training.regenerate import encode_prompts  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("head", nargs="?", default=None, help="a head folder (default: the committed head)")
parser.add_argument("--prompt-slice", type=int, default=1)
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--seeds", type=int, default=3)
args = parser.parse_args()

target, tokenizer = load_target_for_decoding("fp32", None, None, "auto")
head = load_head(args.head or default_head("smollm2-135m-dflash2"), target)
encoded = encode_prompts(tokenizer, heldout_prompts(args.prompts, args.prompt_slice), 1024)
sampler_init = sampling.Sampler.__init__
DRAFT_TEMPERATURE = {"q at T": None, "greedy drafts": 0.0, "q at 0.7": 0.7, "q at 1.5": 1.5}
results = {}
for mode, draft_temperature in DRAFT_TEMPERATURE.items():
    def init(self, *a, _t=draft_temperature, **k):
        sampler_init(self, *a, **k)
        if _t is not None:
            self.draft_temperature = _t
    stats = {}
    for prompt_id, ids in encoded:
        name = "humaneval" if prompt_id.startswith("HumanEval") else "mtbench"
        for seed in range(args.seeds):
            with mock.patch.object(sampling.Sampler, "__init__", init):
                out = speculative_generate(target, head, torch.tensor([ids]), max_new_tokens=args.tokens,
                                           do_sample=True, temperature=1.0, top_k=None, top_p=None,
                                           generator=torch.Generator().manual_seed(seed), adaptive=False,
                                           ngram_size=0, draft_tree=False)
            stats[name] = copy.deepcopy(out.stats) if name not in stats else stats[name].merge(out.stats)
    results[mode] = {name: {"tau": round(s.acceptance_length, 3),
                            "acceptance_1_4": [round(x, 2) for x in s.per_position_acceptance[:4]]}
                     for name, s in stats.items()}
    print(mode, results[mode], flush=True)
save("sampled_draft_tau", {"command": "python " + " ".join(sys.argv), "settings": vars(args), "results": results})
