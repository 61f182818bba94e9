"""The draft pass alone, three ways side by side: what the drafter's matmuls and attention cost.

    python benchmarks/draft_pass.py [--batches 1,8] [--repeats 12] [--output NAME]

One ``draft_block`` call of the committed head, captured from a real fast-loop call (the first HumanEval
prompts, left-padded at batch > 1, 32 new tokens, so its context holds ~200 slots), then timed again and
again in one process, the arms interleaved per repeat (medians of ``--repeats`` x 10 calls), in the dtype
``auto`` decodes in, on the linear kernel ``auto`` picks:

- ``f_linear``: the draft vocabulary's LM-head rows through ``F.linear`` (the loop before session 38);
- ``onednn_head`` (the default since session 38): those rows packed on oneDNN while the target's LM head is;
- ``onednn_head_packed_groups``: also each key/value head's query heads folded into SDPA's query axis, as
  ``attention.packed_gqa_sdpa`` does for the target (tried in session 38 and not kept: no faster here).

Where ``auto`` leaves the target on the default kernel, the draft rows are not packed either, so the first
two arms are the same code (the results record the kernel). Writes benchmarks/results/NAME.{json,md}
(default ``draft_pass_<cpu kind>``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, cpu_kind, save, table  # noqa: E402

import hf_dflash2.modeling_dflash2 as modeling  # noqa: E402
from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts  # noqa: E402
from hf_dflash2.cost_model_dflash2 import linear_kernel_of  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, left_pad, load_head  # noqa: E402

SHIPPED_ATTENTION = modeling.DFlash2Attention.forward
SHIPPED_PACKING = modeling._onednn_packed


def packed_groups_attention(self, x, block_rope, context_kv, attention_mask):
    """The drafter's attention with its query groups folded into the query axis (the mask repeated)."""
    q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))).transpose(1, 2)
    q = modeling.apply_rope(q, *block_rope)
    k_block, v_block = self.project_kv(x, block_rope)
    k = torch.cat([context_kv[0].to(k_block.dtype), k_block], dim=2)
    v = torch.cat([context_kv[1].to(v_block.dtype), v_block], dim=2)
    n, _, width, dim = q.shape
    groups = self.num_heads // self.num_kv_heads
    q = q.reshape(n, self.num_kv_heads, groups * width, dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask.repeat(1, 1, groups, 1),
                                         scale=self.scaling)
    return self.o_proj(out.reshape(n, self.num_heads, width, dim).transpose(1, 2).flatten(-2))


ARMS = {
    "f_linear": (SHIPPED_ATTENTION, lambda weight, kernel: None),
    "onednn_head": (SHIPPED_ATTENTION, SHIPPED_PACKING),
    "onednn_head_packed_groups": (packed_groups_attention, SHIPPED_PACKING),
}


def use(head, arm: str) -> None:
    modeling.DFlash2Attention.forward, modeling._onednn_packed = ARMS[arm]
    head.__dict__.pop("_draft_head", None)  # rebuilt on the next call, packed or not


def captured_draft_call(target, tokenizer, head, batch: int):
    """The arguments of the last ``draft_block`` call of a fast-loop call on ``batch`` HumanEval prompts."""
    ids, mask = left_pad([encode_prompt(tokenizer, p, "cpu") for p in load_humaneval_prompts()[:batch]],
                         tokenizer.pad_token_id)
    captured = {}
    original = type(head).draft_block

    def spy(self, *args, **kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        return original(self, *args, **kwargs)

    type(head).draft_block = spy
    try:
        speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=32,
                             pad_token_id=tokenizer.pad_token_id, draft_tree=False)
    finally:
        type(head).draft_block = original
    return captured["args"], captured["kwargs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.repeats < 1 or any(b < 1 for b in batches):
        raise SystemExit(f"--batches and --repeats must be >= 1, got {args.batches!r} and {args.repeats}")
    target, tokenizer = load_target_for_decoding("auto")
    head = load_head(default_head(), target)
    rows = []
    try:
        for batch in batches:
            use(head, "onednn_head")
            call_args, call_kwargs = captured_draft_call(target, tokenizer, head, batch)
            seconds = {arm: [] for arm in ARMS}
            with torch.no_grad():
                for _ in range(args.repeats):
                    for arm in ARMS:
                        use(head, arm)
                        head.draft_block(*call_args, **call_kwargs)  # builds the draft head for this arm
                        started = time.perf_counter()
                        for _ in range(10):
                            head.draft_block(*call_args, **call_kwargs)
                        seconds[arm].append((time.perf_counter() - started) / 10)
            base = statistics.median(seconds["f_linear"])
            for arm, values in seconds.items():
                rows.append({"batch": batch, "arm": arm, "ms": 1000 * statistics.median(values),
                             "f_linear_over_arm": base / statistics.median(values),
                             "context_slots": call_args[2][0][0].shape[2]})
    finally:
        use(head, "onednn_head")
    name = args.output or f"draft_pass_{cpu_kind()}"
    command = "python benchmarks/draft_pass.py " + " ".join(sys.argv[1:])
    payload = {"command": command, "dtype": str(target.dtype), "linear_kernel": linear_kernel_of(target),
               "repeats": args.repeats, "rows": rows}
    save(name, payload)
    text = (f"{command}\n\nThe committed head's draft pass, {target.dtype}, target linear kernel "
            f"{payload['linear_kernel']}; medians of {args.repeats} interleaved repeats of 10 calls\n\n"
            + table(rows, ["batch", "arm", "ms", "f_linear_over_arm", "context_slots"]))
    (RESULTS / f"{name}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
