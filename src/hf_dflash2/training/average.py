"""Average the weights of heads fine-tuned from one warm start (a "model soup").

    hf-dflash2 average HEAD_A HEAD_B [HEAD_C ...] --output DIR [--weights 0.5,0.5]

Fine-tunes of one head on different mixes trade one prompt set for the other (session 24: a code epoch lifts
HumanEval τ and costs MT-Bench). Their weights stay close enough that a weighted mean is itself a working head,
often better than either on both sets, at no training cost; held-out τ (``benchmarks/heldout_tau.py``) decides.

Every head must share one architecture (``config.json``) and one draft vocabulary: the mean of two heads that
rank different token ids, or read different target layers, means nothing, so that is refused before anything is
written. Floating tensors are averaged in fp32; integer buffers must agree exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

# config fields that name where a head came from, not what it computes
_PROVENANCE_FIELDS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype"}


def parse_weights(spec: str | None, count: int) -> list[float]:
    """``"3,1"`` -> ``[0.75, 0.25]``; ``None`` -> equal weights. Weights must be positive, one per head."""
    if spec is None:
        return [1.0 / count] * count
    try:
        weights = [float(w) for w in spec.split(",")]
    except ValueError:
        raise ValueError(f"--weights {spec!r}: give {count} comma-separated numbers, one per head") from None
    if len(weights) != count:
        raise ValueError(f"--weights {spec!r} has {len(weights)} values for {count} heads")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"--weights {spec!r}: every weight must be a finite number > 0")
    total = sum(weights)
    return [w / total for w in weights]


def _architecture(head: Path) -> dict:
    config_path = head / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{head} is not a saved head: it has no config.json")
    config = json.loads(config_path.read_text())
    return {k: v for k, v in config.items() if k not in _PROVENANCE_FIELDS}


def average_heads(heads: list[str | Path], output: str | Path, weights: list[float] | None = None) -> Path:
    """Save the weighted mean of ``heads`` (saved ``DFlash2DraftModel`` folders) as a head in ``output``.

    The first head supplies everything but the weights (config, draft vocabulary, README). Returns ``output``.
    """
    from ..hub import save_head
    from ..modeling_dflash2 import DFlash2DraftModel

    heads = [Path(h) for h in heads]
    if len(heads) < 2:
        raise ValueError(f"average needs at least two heads, got {[str(h) for h in heads]}")
    weights = weights or [1.0 / len(heads)] * len(heads)
    if len(weights) != len(heads):
        raise ValueError(f"{len(weights)} weights for {len(heads)} heads")
    output = Path(output)
    if output.resolve() in {h.resolve() for h in heads}:
        raise ValueError(f"--output {output} is one of the heads being averaged: write the mean elsewhere")
    reference = _architecture(heads[0])
    for head in heads[1:]:
        architecture = _architecture(head)
        differing = sorted(k for k in reference.keys() | architecture.keys() if reference.get(k) != architecture.get(k))
        if differing:
            raise ValueError(f"{head} differs from {heads[0]} in config fields {differing}: not one architecture")

    models = [DFlash2DraftModel.from_pretrained(h, dtype=torch.float32) for h in heads]
    first_vocab = models[0].draft_vocab
    for head, model in zip(heads[1:], models[1:]):
        vocab = model.draft_vocab
        same = (first_vocab is None and vocab is None) or (
            first_vocab is not None and vocab is not None and torch.equal(first_vocab, vocab)
        )
        if not same:
            raise ValueError(f"{head} has another draft vocabulary than {heads[0]}: their logits rank other ids")

    states = [m.state_dict() for m in models]
    mean = {}
    for name, tensor in states[0].items():
        if tensor.is_floating_point():
            mean[name] = sum(w * s[name].float() for w, s in zip(weights, states)).to(tensor.dtype)
        else:
            for head, state in zip(heads[1:], states[1:]):
                if not torch.equal(state[name], tensor):
                    raise ValueError(f"{head}'s integer buffer {name} differs from {heads[0]}'s: cannot average")
            mean[name] = tensor
    drafter = models[0]
    drafter.load_state_dict(mean)
    saved_dtype = json.loads((heads[0] / "config.json").read_text()).get("dtype", "bfloat16")
    folder = save_head(drafter, output, dtype=getattr(torch, str(saved_dtype), torch.bfloat16))
    recipe_path = heads[0] / "training_recipe.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else {}
    recipe["averaged_from"] = [{"head": str(h), "weight": round(w, 6)} for h, w in zip(heads, weights)]
    (folder / "training_recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    return folder


def cmd_average(args) -> int:
    weights = parse_weights(args.weights, len(args.heads))
    print(average_heads(args.heads, args.output, weights))
    return 0


def register(sub) -> None:
    p = sub.add_parser("average", help="average the weights of heads fine-tuned from one warm start")
    p.add_argument("heads", nargs="+", help="saved head folders (at least two, one architecture and draft vocab)")
    p.add_argument("--output", required=True, help="folder for the averaged head")
    p.add_argument("--weights", default=None, help="comma-separated, one per head (normalised); default equal")
    p.set_defaults(func=cmd_average)
