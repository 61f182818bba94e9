"""Average the weights of heads fine-tuned from one warm start (a "model soup").

    hf-dflash2 average HEAD_A HEAD_B [HEAD_C ...] --output DIR [--weights 0.5,0.5]

Fine-tunes of one head on different mixes trade one prompt set for the other (a code epoch lifts HumanEval τ
and costs MT-Bench; docs/training.md). Their weights stay close enough that a weighted mean is itself a working head,
often better than either on both sets, at no training cost; held-out τ (``benchmarks/training/heldout_tau.py``) decides.

Every head must share one architecture (``config.json``, provenance fields aside) and one draft vocabulary:
the mean of two heads that rank different token ids, or read different target layers, means nothing, so that
is refused before anything is written. So is an ``--output`` that holds an input or is not a head folder
(the save replaces the folder). Floating tensors are averaged in fp32 and saved in the first head's dtype;
integer buffers must agree exactly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

# config fields that name where a head came from or which code version saved it, not what it computes
_PROVENANCE_FIELDS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "auto_map", "architectures"}


def parse_weights(spec: str | None, count: int) -> list[float]:
    """``"3,1"`` -> ``[0.75, 0.25]``; ``None`` -> equal weights. Weights must be positive, one per head."""
    if spec is None:
        return [1.0 / count] * count
    try:
        weights = [float(w) for w in spec.split(",")]
    except ValueError:
        raise ValueError(f"--weights {spec!r}: give {count} comma-separated numbers, one per head") from None
    return _normalised(weights, count, f"--weights {spec!r}")


def _normalised(weights: list[float], count: int, what: str) -> list[float]:
    if len(weights) != count:
        raise ValueError(f"{what} has {len(weights)} values for {count} heads")
    if any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"{what}: every weight must be a finite number > 0")
    total = sum(weights)
    return [w / total for w in weights]


def _flat(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _architecture(head: Path) -> dict:
    config_path = head / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{head} is not a saved head: it has no config.json")
    config = json.loads(config_path.read_text())
    return _flat({k: v for k, v in config.items() if k not in _PROVENANCE_FIELDS})


def _saved_dtype(head: Path) -> torch.dtype:
    """The dtype the head's floating tensors were saved in (bf16 for heads exported here)."""
    from safetensors import safe_open

    with safe_open(head / "model.safetensors", framework="pt") as weights:
        for name in weights.keys():
            tensor = weights.get_slice(name)
            dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(tensor.get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def _check_output(output: Path, heads: list[Path]) -> None:
    """Before any head loads: ``save_head`` replaces the folder it writes, which must hold no input."""
    from ..hub import check_replaceable

    resolved = output.resolve()
    for head in heads:
        if head.resolve() == resolved or head.resolve().is_relative_to(resolved):
            raise ValueError(f"--output {output} is or holds {head}, a head being averaged: write the mean elsewhere")
    check_replaceable(output)


def average_heads(heads: list[str | Path], output: str | Path, weights: list[float] | None = None) -> Path:
    """Save the weighted mean of ``heads`` (saved ``DFlash2DraftModel`` folders) as a head in ``output``.

    ``weights`` (default equal) are normalised to sum to 1. The first head supplies the config and draft
    vocabulary; its ``training_recipe.json`` is copied with ``averaged_from`` added (the ingredients and their
    weights). No README or training history is written: they would describe one run. Returns ``output``.
    """
    from ..hub import save_head
    from ..modeling_dflash2 import DFlash2DraftModel

    heads = [Path(h) for h in heads]
    if len(heads) < 2:
        raise ValueError(f"average needs at least two heads, got {[str(h) for h in heads]}")
    weights = _normalised(list(weights) if weights else [1.0] * len(heads), len(heads), f"weights {weights}")
    output = Path(output)
    _check_output(output, heads)
    reference = _architecture(heads[0])
    for head in heads[1:]:
        architecture = _architecture(head)
        differing = {
            k: (reference.get(k), architecture.get(k))
            for k in sorted(reference.keys() | architecture.keys())
            if reference.get(k) != architecture.get(k)
        }
        if differing:
            raise ValueError(
                f"{head} differs from {heads[0]} in config fields {differing} ({heads[0].name}'s value first): "
                "not one architecture"
            )

    models = [DFlash2DraftModel.from_pretrained(h, dtype=torch.float32) for h in heads]
    first_vocab = models[0].draft_vocab
    for head, model in zip(heads[1:], models[1:]):
        vocab = model.draft_vocab
        if first_vocab is None or vocab is None:
            if first_vocab is not vocab:
                raise ValueError(
                    f"only one of {heads[0]} and {head} has a draft_vocab.json: their logits rank other ids"
                )
        elif not torch.equal(first_vocab, vocab):
            extra = sorted(set(vocab.tolist()) ^ set(first_vocab.tolist()))[:5]
            raise ValueError(
                f"{head} has another draft vocabulary than {heads[0]} ({len(vocab)} against {len(first_vocab)} ids; "
                f"in one only, e.g. {extra}): their logits rank other ids"
            )

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
    recipe_path = heads[0] / "training_recipe.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else {}
    recipe["averaged_from"] = [{"head": str(h), "weight": round(w, 6)} for h, w in zip(heads, weights)]
    folder = save_head(drafter, output, dtype=_saved_dtype(heads[0]))
    (folder / "training_recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    return folder


@dataclass
class AverageSettings:
    """``hf-dflash2 average``'s flags. The heads are its positional operands (what it averages, not a setting);
    ``--weights`` is checked against their count (``parse_weights``)."""

    output: str = field(metadata={"help": "folder for the averaged head"})
    weights: str | None = field(default=None, metadata={
        "help": "comma-separated, one per head (normalised); default equal"})


def cmd_average(args) -> int:
    from ..settings import from_args

    settings = from_args(AverageSettings, args)
    try:
        print(average_heads(args.heads, settings.output, parse_weights(settings.weights, len(args.heads))))
    except (ValueError, OSError) as error:
        raise SystemExit(f"hf-dflash2 average: {error}") from None
    return 0


def register(sub) -> None:
    from ..settings import add_arguments

    p = sub.add_parser("average", help="average the weights of heads fine-tuned from one warm start")
    p.add_argument("heads", nargs="+", help="saved head folders (at least two, one architecture and draft vocab)")
    add_arguments(p, AverageSettings)
    p.set_defaults(func=cmd_average)
