"""Does a round that drafts nothing cost what a plain step costs? One prompt, three methods, interleaved.

    python benchmarks/speed/plain_steps.py [PROMPT_INDEX] [SET]     # defaults: 0 mtbench (128 new tokens)

``ar_onednn`` (plain ``generate`` on oneDNN, the fastest plain greedy on short prompts here), the default loop
(``dflash2_fast``) and the loop forced to plain steps (``ForcedVerifyLengths([0])``: no draft pass, one token
per round through the loop's verify path), each run once to warm up and then 5 times in rotation; prints the
median milliseconds per token and each one's speedup over ``ar_onednn``. Prints only.
"""

import sys
import time

import torch

from hf_dflash2 import speculative_generate
from hf_dflash2.assets import load_prompt_set, load_target
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths
from hf_dflash2.evaluation.bench import Runner
from hf_dflash2.prompts import default_head, encode_prompt, load_head

torch.set_num_threads(2)
idx = int(sys.argv[1]) if len(sys.argv) > 1 else 0
setname = sys.argv[2] if len(sys.argv) > 2 else "mtbench"
target, tok = load_target()
head = load_head(default_head(), target)
runner = Runner(target, tok, {"dflash2": head}, 128, 0.0)
p = load_prompt_set(setname, idx + 1)[idx]
ids = encode_prompt(tok, p, target.device)
mask = torch.ones_like(ids)


def plain_only():
    t = time.perf_counter()
    r = speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=128, do_sample=False,
                             pad_token_id=tok.pad_token_id, verify_policy=ForcedVerifyLengths([0]))
    return int(r.num_generated.sum()), time.perf_counter() - t, r.stats


res = {m: [] for m in ("ar_onednn", "dflash2_fast", "plain_only")}
for m in res:  # warm
    (plain_only() if m == "plain_only" else runner.run(m, ids, mask))
for rep in range(5):
    for m in res:
        if m == "plain_only":
            g, s, st = plain_only()
        else:
            g, s, st, _ = runner.run(m, ids, mask)
        res[m].append(s / g)
        if st is not None and rep == 0:
            print(m, "rounds", st.rounds, "drafts", st.draft_passes, "tau", round(st.acceptance_length, 2),
                  "ngram", st.ngram_rounds, "tree", st.tree_rounds)
import statistics as S  # noqa: E402

base = S.median(res["ar_onednn"])
for m, v in res.items():
    print(f"{m:14s} ms/tok median {1000 * S.median(v):.2f}  speedup {base / S.median(v):.3f}  "
          f"all {[round(1000 * x, 1) for x in v]}")
