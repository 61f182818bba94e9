"""Turn a training run's checkpoint into a committed, Hub-ready head (bf16 safetensors + remote code).

    python -m hf_dflash2.training.export RUN_DIR HEAD_DIR [--step N]

``--step`` refuses a checkpoint at another step, so two heads compared "at the same budget" really are.
The run's settings and loss history go to ``training_recipe.json`` beside the weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def export_head(
    run_dir: str | Path,
    head_dir: str | Path,
    step: int | None = None,
    base_model: str | None = None,
    fallback: dict | None = None,
    data_path: str | None = None,
    max_sequences: int | None = None,
    data_description: str | None = None,
    ema: bool = False,
    target: str | None = None,
    gguf_file: str | None = None,
) -> Path:
    """A saved head from a run's checkpoint: its weights, or with ``ema`` their moving average.

    ``target`` (folder or Hub id; ``gguf_file`` inside it): the model the run trained for; by default the
    one the run recorded, else (a run saved by 0.1.0 may record none) the offline SmolLM2-135M-Instruct."""
    from ..assets import SMOLLM2_HUB_ID, load_target
    from ..hub import save_head
    from .losses import decay_gamma

    run_dir = Path(run_dir)
    checkpoint = run_dir / "checkpoint.pt"
    if not checkpoint.exists():
        raise FileNotFoundError(f"{checkpoint} does not exist: train first")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    if step is not None and state["step"] != step:
        raise ValueError(f"{checkpoint} is at step {state['step']}, not the requested step {step}")
    config = state["config"]
    if ema and state.get("drafter_ema") is None:
        raise ValueError(f"{checkpoint} holds no moving average of the weights: train with --ema-decay to export --ema")
    extra = config.get("extra", {})
    if target is None and "target" in extra:  # runs record their target (some saved by 0.1.0 do not)
        target, gguf_file = extra["target"], extra.get("gguf_file")
    model, _ = load_target(target, gguf_file)
    drafter = _drafter_from_state(model, state, fallback or {})
    drafter.load_state_dict(state["drafter_ema"] if ema else state["drafter"])
    if config["vocab_subset"] == "data":
        drafter.set_draft_vocab(_data_vocab(state, data_path, config, max_sequences))
    drafter.config.base_model = base_model or target or SMOLLM2_HUB_ID
    folder = save_head(drafter, head_dir, dtype=torch.bfloat16)
    recipe = {
        "steps": state["step"],
        "planned_steps": config["steps"],
        "sequences_per_step": config["batch_size"],
        "anchors_per_sequence": config["anchors_per_sequence"],
        "learning_rate": config["learning_rate"],
        "warmup_ratio": config["warmup_ratio"],
        "warmup_steps": config.get("warmup_steps"),
        "logit_ramp_steps": config.get("logit_ramp_steps"),
        "standardize_features": config.get("standardize_features", False),
        "output_scale": config.get("output_scale"),
        "grad_clip": config["grad_clip"],
        "selector_weight": config["selector_weight"],
        "vocab_subset": config["vocab_subset"],
        "seed": config["seed"],
        "label_source": config.get("label_source", "data"),
        "hidden_weight": config.get("hidden_weight", 0.0),
        "loss_gamma": decay_gamma(drafter.config.block_size, config.get("loss_gamma")),  # the decay the run used
        "copy_weight": config.get("copy_weight", 1.0),
        "loop_anchor_share": config.get("loop_anchor_share", 0.0),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "mixed_precision": config.get("mixed_precision"),
        "initialized_from": state.get("initialized_from"),
        "weights": f"moving average, decay {config['ema_decay']}" if ema else "last step",
        "block_positions": state["history"][-1].get("block_positions") if state["history"] else None,
        "train_minutes": round(state["history"][-1].get("train_seconds", 0) / 60, 1) if state["history"] else None,
        "data": data_description
        or config.get("extra", {}).get("data")
        or "SmolLM2-135M-Instruct's own greedy responses to ShareGPT first turns (regenerated)",
        "final_loss_mean_last_25": sum(h["loss"] for h in state["history"][-25:]) / max(1, len(state["history"][-25:])),
    }
    (folder / "training_recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    (folder / "training_history.json").write_text(json.dumps(thin_history(state["history"])) + "\n")
    return folder


def thin_history(history: list[dict], keep: int = 800) -> list[dict]:
    """At most about ``keep`` evenly spaced entries, plus every evaluation and the last step: a long run's
    per-step log would otherwise weigh megabytes in every published head."""
    stride = max(1, -(-len(history) // keep))
    return [h for i, h in enumerate(history) if i % stride == 0 or "eval_tau" in h or i == len(history) - 1]


def _data_vocab(state, data_path, config, max_sequences=None) -> list[int]:
    """The token ids the head was trained to rank (the trainer's vocab subset)."""
    if "vocab_subset" in state:
        return state["vocab_subset"]
    if data_path is None:
        raise ValueError("this checkpoint does not record its vocab subset: pass --data (and --max-sequences)")
    from .trainer import load_sequences

    sequences = load_sequences(data_path, config["max_length"])[:max_sequences]
    return sorted({t for s in sequences for t in s["input_ids"][s["response_start"] :]})


def _drafter_from_state(target, state, fallback: dict):
    """Rebuild the head's architecture from the tensor shapes in the checkpoint."""
    from ..modeling_dflash2 import DFlash2DraftModel

    tensors = state["drafter"]
    layers = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("layers."))
    dflash2 = "candidate_selector.successor_codebook" in tensors
    taps = tensors["fc.weight"].shape[1] // tensors["fc.weight"].shape[0]
    kwargs = {}
    if dflash2:
        kwargs["selector_rank"] = tensors["candidate_selector.successor_codebook"].shape[1]
    recorded = state.get("drafter_config") or ({"dflash_config": fallback} if fallback else None)
    if recorded:
        dflash = recorded["dflash_config"]
        kwargs["target_layer_ids"] = dflash["target_layer_ids"]
        kwargs["mask_token_id"] = dflash["mask_token_id"]
        kwargs["block_size"] = dflash["block_size"]
        if dflash2:
            kwargs["selector_top_k"] = dflash.get("selector_top_k", 16)
    else:
        raise ValueError("checkpoint has no drafter_config: pass --target-layer-ids, --mask-token-id and --block-size")
    drafter = DFlash2DraftModel.for_target(target, num_hidden_layers=layers, dflash2=dflash2, **kwargs)
    if len(drafter.config.target_layer_ids) != taps:
        raise ValueError(
            f"checkpoint's fc.weight reads {taps} tapped layers, but its target_layer_ids "
            f"{drafter.config.target_layer_ids} name {len(drafter.config.target_layer_ids)}"
        )
    return drafter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("head_dir")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--target-layer-ids", default=None, help="only for checkpoints without drafter_config")
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--data", default=None, help="training data, for checkpoints that do not record their vocab subset"
    )
    parser.add_argument("--max-sequences", type=int, default=None)
    parser.add_argument("--data-description", default=None, help="what the head was trained on, for the card")
    parser.add_argument("--ema", action="store_true", help="the weights' moving average (a run with --ema-decay)")
    parser.add_argument("--target", default=None, help="the run's target (default: the one it recorded; runs "
                        "saved by 0.1.0 may record none: they mean the offline SmolLM2-135M-Instruct)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --target")
    args = parser.parse_args(argv)
    fallback = None
    if args.target_layer_ids:
        from .config import parse_layer_ids

        try:
            layer_ids = parse_layer_ids(args.target_layer_ids)
        except ValueError as error:
            raise SystemExit(f"export: {error}") from None
        fallback = {
            "target_layer_ids": layer_ids,
            "mask_token_id": args.mask_token_id,
            "block_size": args.block_size,
            "selector_top_k": 16,
        }
    try:
        folder = export_head(
            args.run_dir,
            args.head_dir,
            args.step,
            fallback=fallback,
            data_path=args.data,
            max_sequences=args.max_sequences,
            data_description=args.data_description,
            ema=args.ema,
            target=args.target,
            gguf_file=args.gguf_file,
        )
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"export: {error}") from None
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
