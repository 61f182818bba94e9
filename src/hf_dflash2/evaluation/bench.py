"""``hf-dflash2 bench``: every decoding method on the same prompts, interleaved, in one process.

Methods (a method that cannot run in a configuration is skipped and the reason recorded):

- ``ar``: plain ``generate`` (greedy, or sampling at T > 0), batch 1 or a left-padded batch, on the target as
  loaded (PyTorch's default linear kernel, Transformers' attention); ``ar_onednn`` and ``ar_packed`` (added
  with any of the three, where they apply): the same with every linear layer on oneDNN with packed weights, and on this
  package's packed grouped-query attention with each forward's linear kernel chosen for its width
  (``PLAIN_CONFIGURATIONS``). **The baseline of every speedup is the fastest of them on each prompt set**
  (``fastest_baseline``): the fastest plain ``generate`` this machine has for the target, in the same dtype.
  ``speedup_vs_as_loaded`` compares with ``ar`` alone;
- ``dflash2_generate``: ``target.generate(assistant_model=dflash2_head)`` (batch 1);
- ``dflash2_fast``: ``hf_dflash2.speculative_generate`` with the dFlash 2 head (any batch), n-gram drafts
  and draft trees on (the defaults, the kernel chosen per forward);
- ``dflash2_fast_chains``: the same with ``draft_tree=False``: one chain a round (when sampling, of drafts
  drawn from the head's q, as on every round without trees), n-gram drafts still on; on a sliding-window
  target, where trees are off anyway, it is ``dflash2_fast``;
- ``dflash2_fast_head``: the same with ``ngram_size=0, draft_tree=False``: the head's own chain alone, its
  length chosen by the adaptive policy;
- ``dflash2_fixed_block``: the fast loop verifying the head's whole block every round (``adaptive=False``, no
  n-gram drafts, no trees, plain greedy whatever the target's generation config asks): the rounds the
  reference loop runs and vLLM and SGLang verify, on this loop's code. Its tau is the head's held-out tau
  (``heldout_tau.py``, the cards of ``hf-dflash2 distill``). For a target whose generation config sets a
  processor (a repetition penalty, say) its text is plain greedy's, not ``ar``'s;
- ``dflash1_fast``: the fast loop with the DFlash-1 head trained on the same budget;
- ``prompt_lookup``: Transformers' prompt-lookup decoding (batch 1, greedy);
- ``native_dflash``: Transformers' own ``speculation_type="dflash"`` path with the DFlash-1 head's
  weights mapped into its ``MuseGlimmerAssistantModel`` (batch 1);
- ``zlab_reference``: the z-lab reference loop (``pip install --no-deps dflash==0.1.0``,
  ``dflash.model.dflash_generate``, batch 1, a fixed block) with the same dFlash 2 head, on the same
  per-forward kernels as ours.

Per method and prompt set: tau (mean tokens per target forward) and per-position acceptance, tokens/s
(median over prompts), speedup over the baseline (ratio of medians of per-prompt wall time per token), the
speedup on every single prompt and the worst of them, and the spread of wall time per prompt. For the fast
loop also the bound it can reach (``speed_bound``): c_d (a draft pass / a plain step of the baseline), v (the
verifies it chose / a plain step), tau / (c_d * drafted share + v) over the decoding, and the same over a whole
call, the baseline's prefill of the prompt included (long prompts spend much of a call there). Greedy runs also report on how many
prompts the text of a method's median run equals that of ``ar`` (the model as loaded), and the speedup over
those prompts alone (fp32: every text equals it). Output: JSON + Markdown table + PNG chart in ``--output``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from unittest import mock

import torch
from tqdm.auto import tqdm

from ..charts import charts_available, save_chart
from ..cost_model_dflash2 import _device_name
from ..cpu.attention import packed_gqa_attention, packs_gqa
from ..hub import card_results  # noqa: F401  (re-exported: bench reports become card numbers)
from ..kernels_dflash2 import ForwardKernels, onednn_available, shared_switch
from ..prompts import (
    apply_chat_template_option,
    check_head_matches_target,
    default_head,
    encode_prompt,
    left_pad,
    load_head,
)
from ..settings import BENCH_METHODS, BenchCommand, BenchSettings, add_arguments, from_args
from ..speculative_dflash2 import SpeculativeStats


def to_native_dflash(drafter):
    """Map a DFlash-1 head into Transformers' native DFlash assistant, or raise if it does not map."""
    from transformers.models.muse_glimmer_assistant.configuration_muse_glimmer_assistant import (
        MuseGlimmerAssistantConfig,
    )
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import MuseGlimmerAssistantModel

    cfg = drafter.config
    if cfg.use_conv or cfg.use_selector:
        raise ValueError("the native path has no conv and no selector: only DFlash-1 heads map")
    native_cfg = MuseGlimmerAssistantConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
        layer_types=list(cfg.layer_types),
        rope_parameters=dict(cfg.rope_parameters),
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=cfg.target_layer_ids,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    native = MuseGlimmerAssistantModel(native_cfg).to(drafter.dtype).eval()
    renamed = {}
    for name, tensor in drafter.state_dict().items():
        name = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}.get(name, name)
        renamed[name] = tensor
    missing, unexpected = native.load_state_dict(renamed, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise ValueError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return native


def cpu_name() -> str:
    """The CPU's model name (``platform.processor()`` is empty on Linux)."""
    return _device_name(torch.device("cpu"))


def load_reference_head(folder, target):
    """The z-lab reference implementation's model of the dFlash 2 head at ``folder`` (in the target's dtype,
    on its device), or a string saying why it cannot run."""
    if folder is None:
        return "no dFlash 2 head"
    dflash_config = json.loads((Path(folder) / "config.json").read_text()).get("dflash_config", {})
    if dflash_config.get("sandwich_norms"):  # it would load, drop those norms and draft something else
        return "the reference's Qwen3 layers have no sandwich norms (a Gemma-style head)"
    try:
        from dflash.model import DFlash2DraftModel as ReferenceHead
    except ImportError:
        return "the reference is not installed (pip install --no-deps dflash==0.1.0; make setup does)"
    try:
        return ReferenceHead.from_pretrained(folder, dtype=target.dtype).to(target.device).eval()
    except Exception as error:  # recorded in the report, not fatal
        return f"the reference cannot load {folder}: {error}"


def generated_texts(sequences: torch.Tensor, prompt_length: int, pad_token_id: int) -> list[tuple[int, ...]]:
    """Each row's tokens after the prompt, trailing padding dropped (the same rule for every method, so
    that texts compare equal whether a method pads finished rows or not)."""
    texts = []
    for row in sequences[:, prompt_length:].tolist():
        while row and row[-1] == pad_token_id:
            row.pop()
        texts.append(tuple(row))
    return texts


def generated_tokens(sequences: torch.Tensor, prompt_length: int, eos_token_id) -> int:
    """Tokens a plain ``generate`` call produced over its rows, counted as the fast loop counts ``num_generated``:
    each row up to and including its first EOS (``generate`` pads the columns after it), every column for a
    row without one. Counting the tokens that are not the pad id would miss each EOS when the pad id is EOS."""
    from ..generation.config import eos_tensor

    new = sequences[:, prompt_length:]
    ends = torch.isin(new, eos_tensor(eos_token_id, new.device))
    return int(torch.where(ends.any(1), ends.int().argmax(1) + 1, new.shape[1]).sum())


def refused_by_settings(method: str, batch_size: int, sample: bool) -> str | None:
    """Why ``method`` cannot run at this batch size and decoding, whatever the target and heads (None: it can)."""
    if batch_size > 1 and method in ("dflash2_generate", "prompt_lookup", "native_dflash"):
        return "Transformers' assisted loop runs at batch size 1 only"
    if sample and method == "prompt_lookup":
        return "prompt lookup has no proposal distribution for lossless sampling"
    if sample and method == "dflash2_fixed_block":
        return "the head's held-out tau is measured greedy"
    if method == "zlab_reference" and (sample or batch_size > 1):
        return "the reference loop is compared at batch 1, greedy"
    return None


class Runner:
    """Runs one method on one batch of prompts; returns generated token count, wall time, stats, texts."""

    def __init__(self, target, tokenizer, heads: dict, max_new_tokens: int, temperature: float,
                 top_k: int | None = None, top_p: float | None = None, linear_kernel: str | None = "auto",
                 head_paths: dict | None = None):
        self.target, self.tokenizer, self.heads = target, tokenizer, heads
        self.linear_kernel, self.head_paths = linear_kernel, head_paths or {}
        self._reference = None
        self.max_new_tokens, self.temperature, self.top_k, self.top_p = max_new_tokens, temperature, top_k, top_p
        self.sample = temperature > 0
        self.eos = target.generation_config.eos_token_id
        self.pad = tokenizer.pad_token_id
        self._native = None

    def sampling_kwargs(self):
        if self.sample:
            return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}

    def supports(self, method: str, batch: int) -> str | None:
        """None if the method can run here, else why not."""
        if method in ("dflash2_generate", "dflash2_fast", "dflash2_fast_chains", "dflash2_fast_head",
                      "dflash2_fixed_block") and "dflash2" not in self.heads:
            return "no dFlash 2 head"
        if method in ("dflash1_fast", "native_dflash") and "dflash1" not in self.heads:
            return "no DFlash-1 head"
        refused = refused_by_settings(method, batch, self.sample)
        if refused:
            return refused
        if method in PLAIN_CONFIGURATIONS:
            return plain_unsupported(self.target, method)
        if method == "zlab_reference":
            if self._reference is None:
                self._reference = load_reference_head(self.head_paths.get("dflash2"), self.target)
            if isinstance(self._reference, str):
                return self._reference
        if method == "native_dflash":
            if self._native is None:
                try:
                    self._native = to_native_dflash(self.heads["dflash1"])
                except Exception as error:  # recorded in the report, not fatal
                    self._native = error
            if isinstance(self._native, Exception):
                return f"DFlash-1 weights do not map into the native assistant: {self._native}"
        return None

    @torch.no_grad()
    def prefill_seconds(self, method: str, ids: torch.Tensor, mask: torch.Tensor) -> float:
        """Wall time of a plain configuration's (``PLAIN_CONFIGURATIONS``) forward over the prompts, as
        ``generate``'s first step runs it: what every method pays once before decoding."""
        synchronize = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
        with plain_configuration(self.target, method, ids.shape[0]):
            synchronize()
            started = time.perf_counter()
            self.target(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            synchronize()
            return time.perf_counter() - started

    @torch.no_grad()
    def run(self, method: str, ids: torch.Tensor, mask: torch.Tensor):
        from ..generation import PLAIN_GREEDY, speculative_generate

        n = self.max_new_tokens
        common = dict(max_new_tokens=n, pad_token_id=self.pad, **self.sampling_kwargs())
        stats = None
        started = time.perf_counter()
        if method in PLAIN_CONFIGURATIONS:
            with plain_configuration(self.target, method, ids.shape[0]):
                out = self.target.generate(ids, attention_mask=mask, **common)
            generated = generated_tokens(out, ids.shape[1], self.eos)
        elif method == "zlab_reference":
            import dflash.model as reference_loop

            reference = self._reference
            eos = self.eos if isinstance(self.eos, list) else [self.eos]
            # its statistics time with torch.cuda.synchronize(); off CUDA the plain clock serves
            clock = (contextlib.nullcontext() if self.target.device.type == "cuda"
                     else mock.patch.object(reference_loop, "_cuda_time", time.perf_counter))
            with ForwardKernels(self.target, reference, 1, reference.block_size, self.linear_kernel), clock:
                result = reference_loop.dflash_generate(reference, self.target, ids, n, stop_token_ids=eos,
                                                        temperature=0.0, return_stats=True)
            out = result.output_ids
            generated = out.shape[1] - ids.shape[1]
            stats = SpeculativeStats(reference.block_size)
            for produced in result.acceptance_lengths:
                stats.record(torch.tensor([produced - 1]), torch.tensor([produced]), verified=reference.block_size - 1)
            stats.verify_forwards = stats.draft_passes = len(result.acceptance_lengths)
        elif method in ("dflash2_fast", "dflash2_fast_chains", "dflash2_fast_head", "dflash1_fast"):
            head = self.heads["dflash1" if method == "dflash1_fast" else "dflash2"]
            result = speculative_generate(
                self.target, head, ids, attention_mask=mask, max_new_tokens=n, do_sample=self.sample,
                temperature=self.temperature or 1.0, top_k=self.top_k if self.sample else None,
                top_p=self.top_p if self.sample else None, pad_token_id=self.pad, linear_kernel=self.linear_kernel,
                **({"ngram_size": 0, "draft_tree": False} if method == "dflash2_fast_head" else {}),
                **({"draft_tree": False} if method == "dflash2_fast_chains" else {}),
            )
            generated, stats, out = int(result.num_generated.sum()), result.stats, result.sequences
        elif method == "dflash2_fixed_block":
            result = speculative_generate(self.target, self.heads["dflash2"], ids, attention_mask=mask, max_new_tokens=n,
                                          pad_token_id=self.pad, linear_kernel=self.linear_kernel, adaptive=False,
                                          ngram_size=0, draft_tree=False, **PLAIN_GREEDY)
            generated, stats, out = int(result.num_generated.sum()), result.stats, result.sequences
        elif method == "dflash2_generate":
            head = self.heads["dflash2"]
            head.linear_kernel = self.linear_kernel
            out = self.target.generate(ids, attention_mask=mask, assistant_model=head, **common)
            generated, stats = out.shape[1] - ids.shape[1], head.last_speculative_stats
        elif method == "prompt_lookup":
            out = self.target.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=10, **common)
            generated = out.shape[1] - ids.shape[1]
        elif method == "native_dflash":
            out = self.target.generate(ids, attention_mask=mask, assistant_model=self._native, speculation_type="dflash", **common)
            generated = out.shape[1] - ids.shape[1]
        else:
            raise ValueError(f"unknown method {method!r}; choose from {list(BENCH_METHODS)}")
        seconds = time.perf_counter() - started
        return generated, seconds, stats, generated_texts(out, ids.shape[1], self.pad)


def bench_heads(args) -> dict[str, str]:
    """The heads a bench run loads, by kind ("dflash2", "dflash1"): ``--head`` / ``--dflash1-head`` if given
    (refused by name without a ``config.json``), else an offline target's committed heads. Before any load."""
    from ..assets import offline_target

    heads_paths = {}
    offline = offline_target(args.target)  # an offline target's committed heads are the default ones
    committed_dflash2 = offline.head if offline else None
    committed_dflash1 = "smollm2-135m-dflash1" if offline and offline.head == "smollm2-135m-dflash2" else None
    for name, given, committed in (("dflash2", args.head, committed_dflash2),
                                   ("dflash1", args.dflash1_head, committed_dflash1)):
        if given and not (Path(given) / "config.json").is_file():  # a typo must not turn into "no head"
            raise SystemExit(f"--{'head' if name == 'dflash2' else 'dflash1-head'} {given}: no head there "
                             "(no config.json)")
        folder = given or (default_head(committed) if committed else None)
        if name == "dflash2" and folder is None and offline is not None and offline.build_head:
            raise SystemExit(f"--target {args.target}: heads/{committed} is not in this checkout; build it with "
                             f"`{offline.build_head}` or pass --head FOLDER")
        if folder:
            heads_paths[name] = str(folder)
    return heads_paths


def run_benchmark(args: BenchSettings, command_line: str = "hf-dflash2 bench") -> dict:
    from ..assets import load_prompt_set
    from ..prompts import parse_chat_template

    torch.manual_seed(args.seed)
    methods = args.methods.split(",")
    parse_chat_template(args.chat_template)  # before any model load
    from ..assets import offline_target

    offline = offline_target(args.target)
    heads_paths = bench_heads(args)
    datasets = {name: load_prompt_set(name, args.limit) for name in args.sets.split(",")}  # validates names
    from ..cpu.precision import load_target_for_decoding

    target, tokenizer = load_target_for_decoding(args.mixed_precision, args.target, args.gguf_file,
                                                 args.linear_kernel)
    apply_chat_template_option(tokenizer, args.chat_template)
    for folder in heads_paths.values():
        check_head_matches_target(folder, target)
    heads = {name: load_head(folder, target) for name, folder in heads_paths.items()}
    runner = Runner(target, tokenizer, heads, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                    args.linear_kernel, heads_paths)
    methods = with_every_baseline(methods)
    report = {
        "command": command_line,
        "target": offline.hub_id if offline else args.target,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or cpu_name(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "device": str(target.device),
                    "dtype": str(target.dtype).removeprefix("torch."),  # what `auto` chose, every method
                    "linear_kernel": args.linear_kernel},
        "settings": {k: getattr(args, k) for k in ("sets", "limit", "max_new_tokens", "temperature", "top_k", "top_p",
                                                   "batch_size", "methods", "chat_template", "repeats")},
        "heads": heads_paths,
        "skipped": {},
        "datasets": {},
    }
    for method in methods:
        reason = runner.supports(method, args.batch_size)
        if reason:
            report["skipped"][method] = reason
    active = [m for m in methods if m not in report["skipped"]]
    if not active:
        raise SystemExit("error: none of the methods can run here: "
                         + "; ".join(f"{m}: {why}" for m, why in report["skipped"].items()))
    first = next(iter(datasets.values()))[: args.batch_size]
    warm_up(runner, tqdm(active, desc="warm-up", unit="method"),
            *left_pad([encode_prompt(tokenizer, p, target.device) for p in first], tokenizer.pad_token_id))
    total = sum(-(-len(p) // args.batch_size) for p in datasets.values()) * len(active) * args.repeats
    progress = tqdm(total=total, desc="bench", unit="run")
    for name, prompts in datasets.items():
        per_method = {m: {"tokens": [], "seconds": []} for m in active}
        for batch_index, start in enumerate(range(0, len(prompts), args.batch_size)):
            rows = [encode_prompt(tokenizer, p, target.device) for p in prompts[start : start + args.batch_size]]
            ids, mask = left_pad(rows, tokenizer.pad_token_id)
            # Interleaved: every method on this prompt before the next prompt, the order rotated per prompt
            # and per repeat so that no method always runs right after the same other one.
            runs = {m: [] for m in active}
            for repeat in range(args.repeats):
                for method in rotated(active, batch_index + repeat):
                    generated, seconds, stats, texts = runner.run(method, ids, mask)
                    runs[method].append((generated, seconds, texts))
                    if stats is not None:
                        per_method[method].setdefault("stats_list", []).append(stats.as_dict())
                    progress.update(1)
            for method in BASELINE_METHODS:  # the prefill both sides pay, for the bound over a whole call
                if method in per_method:
                    per_method[method].setdefault("prefill_seconds", []).append(
                        runner.prefill_seconds(method, ids, mask))
            add_prompt(per_method, runs, compare_texts=not runner.sample)
        report["datasets"][name] = summarize(per_method, args.batch_size)
    progress.close()
    return report


def add_prompt(per_method: dict, runs: dict[str, list[tuple]], compare_texts: bool) -> None:
    """Each method's median run (tokens, seconds, texts) on one prompt (batch) joins ``per_method``; with
    ``compare_texts`` (greedy) also whether its text equals that of AR's median run."""
    ar_texts = median_run(runs["ar"])[2] if compare_texts and "ar" in runs else None
    for method, method_runs in runs.items():
        generated, seconds, texts = median_run(method_runs)
        per_method[method]["tokens"].append(generated)
        per_method[method]["seconds"].append(seconds)
        if ar_texts is not None:
            per_method[method].setdefault("same_text", []).append(texts == ar_texts)


def median_run(runs: list[tuple]) -> tuple:
    """The run (tokens, seconds, ...) with the median seconds per token (the slower middle one of an even
    count): sampled runs differ in length, so tokens, seconds and text are taken from one run, not each's
    median."""
    if not runs:
        raise ValueError("no runs to take the median of")
    return sorted(runs, key=lambda run: run[1] / max(run[0], 1))[len(runs) // 2]


def rotated(items: list, shift: int) -> list:
    """``items`` started at index ``shift`` (mod its length), wrapping around."""
    shift = shift % len(items) if items else 0
    return items[shift:] + items[:shift]


def warm_up(runner: Runner, methods: Iterable[str], ids: torch.Tensor, mask: torch.Tensor) -> None:
    """One short untimed run of every method on ``ids`` before any timing: kernels get compiled and allocated,
    and the adaptive paths measure (or load) their cost model here instead of inside the first timed prompt."""
    timed_tokens, runner.max_new_tokens = runner.max_new_tokens, min(8, runner.max_new_tokens)
    try:
        for method in methods:
            runner.run(method, ids, mask)
    finally:
        runner.max_new_tokens = timed_tokens


@dataclasses.dataclass(frozen=True)
class PlainConfiguration:
    """One way to run plain ``generate``: the linear kernel (``ForwardKernels``' choices; None: as loaded) and
    whether the packed grouped-query attention runs instead of the model's own."""

    linear_kernel: str | None
    packed_attention: bool
    description: str
    card_name: str  # how a model card names it ("timed on ... and ...")


# The plain ``generate`` configurations a speedup is measured against; the fastest on a prompt set wins.
# ``ar_packed`` is what this package gives plain decoding: its attention is no part of speculation, so a
# speedup must not count it (how much it gives plain greedy: docs/benchmarks.md).
PLAIN_CONFIGURATIONS = {
    "ar": PlainConfiguration(None, False, "as loaded (PyTorch's default linear kernel, the model's attention)",
                             "PyTorch's default linear kernel"),
    "ar_onednn": PlainConfiguration("onednn", False, "every linear layer on oneDNN with packed weights",
                                    "oneDNN linear kernels"),
    "ar_packed": PlainConfiguration("auto", True, "the packed grouped-query attention, each forward's linear "
                                                  "kernel chosen for its width (on a CPU)",
                                    "the packed grouped-query attention"),
}
BASELINE_METHODS = tuple(PLAIN_CONFIGURATIONS)


def with_every_baseline(methods: list[str]) -> list[str]:
    """``methods`` with every plain configuration after the first one listed: the baseline is the fastest of
    them all, so naming one times them all (none listed: none added)."""
    first = next((i for i, m in enumerate(methods) if m in BASELINE_METHODS), None)
    if first is None:
        return list(methods)
    rest = [m for m in methods if m not in BASELINE_METHODS]
    return rest[:first] + list(BASELINE_METHODS) + rest[first:]


def onednn_packs(target) -> bool:
    """Whether ``ar_onednn`` can run: a CPU target whose linear layers oneDNN can pack here."""
    parameter = next(target.parameters())
    return onednn_available() and parameter.device.type == "cpu" and shared_switch(target) is not None


def plain_unsupported(target, method: str) -> str | None:
    """None if the plain configuration ``method`` applies to ``target`` here, else why not."""
    if method == "ar_onednn" and not onednn_packs(target):
        return "oneDNN cannot pack this target's weights here"
    if method == "ar_packed" and not packs_gqa(target):
        return "the packed grouped-query attention does not apply to this target (no grouped-query sdpa)"
    return None


@contextlib.contextmanager
def plain_configuration(target, method: str, batch_size: int):
    """Within the block, ``target`` runs as the plain configuration ``method`` says; restored on exit."""
    configuration = PLAIN_CONFIGURATIONS[method]
    with (packed_gqa_attention(target, configuration.packed_attention),
          ForwardKernels(target, None, batch_size, 1, configuration.linear_kernel)):
        yield


def seconds_per_token(data: dict) -> list[float]:
    return [s / max(t, 1) for s, t in zip(data["seconds"], data["tokens"])]


def fastest_baseline(per_method: dict) -> str | None:
    """The plain ``generate`` configuration (``BASELINE_METHODS``) with the least median seconds per token on
    this prompt set: the baseline every speedup is measured against. None when no plain run was timed."""
    timed = {m: statistics.median(seconds_per_token(per_method[m])) for m in BASELINE_METHODS if m in per_method}
    return min(timed, key=timed.get) if timed else None


def speed_bound(stats_list: list[dict], step_seconds: float, batch_size: int = 1,
                prefill_seconds: float = 0.0) -> dict | None:
    """What the loop's runs could reach at most: tau / (c_d * drafted + v) over the decoding (``decode_bound``),
    where tau is tokens per row and target forward, c_d a draft pass and v the verifies it chose (each run's
    from the cost model it decided with, timed near its own context), each over a plain step of the baseline,
    and ``drafted`` the share of rounds that ran a draft pass. ``bound`` is the same over a whole call: the
    prompt's prefill P, which both sides pay once, plus the baseline's decoding D, (P + D) / (P + D /
    decode_bound).

    ``step_seconds``: the baseline's whole-call seconds per token times the batch; ``prefill_seconds``: its
    prefill per call, which that figure includes, so a plain step is ``step_seconds`` less the prefill's
    share. None without the counts or the cost models."""
    forwards = sum(s.get("verify_forwards", 0) for s in stats_list)
    if not forwards or step_seconds <= 0 or not all(s.get("costs") for s in stats_list):
        return None
    whole_call = sum(s["committed"] for s in stats_list) / len(stats_list) * step_seconds / batch_size  # P + D
    decode = max(whole_call - prefill_seconds, 0.05 * whole_call)
    plain_step = step_seconds * decode / whole_call
    draft_passes = sum(s.get("draft_passes", 0) for s in stats_list)
    draft_seconds = verify_seconds = 0.0
    for stats in stats_list:
        costs = stats["costs"]["verify_seconds"]
        draft_seconds += stats.get("draft_passes", 0) * stats["costs"]["draft_seconds"]
        verify_seconds += sum(n * costs[min(k, len(costs) - 1)] for k, n in enumerate(stats["verify_length_histogram"]))
    tau = sum(s["committed"] for s in stats_list) / forwards / batch_size
    drafted = draft_passes / forwards
    c_d = draft_seconds / max(draft_passes, 1) / plain_step
    v = verify_seconds / max(sum(sum(s["verify_length_histogram"]) for s in stats_list), 1) / plain_step
    decode_bound = tau / (c_d * drafted + v)
    prefill = whole_call - decode
    return {"tau": tau, "c_d": c_d, "drafted_share": drafted, "v": v, "decode_bound": decode_bound,
            "prefill_share": prefill / whole_call, "bound": whole_call / (prefill + decode / decode_bound)}


def summarize(per_method: dict, batch_size: int = 1) -> dict:
    """Per method: speeds, the speedup over the fastest plain ``generate`` (``fastest_baseline``: the key
    ``speedup_vs_ar``, per prompt and at the worst prompt) and over the target as loaded (``ar``), tau,
    acceptance by position, and for the loops the bound and the share of it reached."""
    out = {}
    baseline = fastest_baseline(per_method)
    base_spt = statistics.median(seconds_per_token(per_method[baseline])) if baseline else None
    loaded_spt = statistics.median(seconds_per_token(per_method["ar"])) if "ar" in per_method else None
    for method, data in per_method.items():
        spt = seconds_per_token(data)
        entry = {
            "prompts": len(data["seconds"]),
            "tokens_per_s_median": statistics.median(t / s for s, t in zip(data["seconds"], data["tokens"])),
            "seconds_per_prompt_median": statistics.median(data["seconds"]),
            "seconds_per_prompt_min": min(data["seconds"]),
            "seconds_per_prompt_max": max(data["seconds"]),
            "tokens_total": sum(data["tokens"]),
        }
        if baseline is not None:
            entry["is_baseline"] = method == baseline
            entry["speedup_vs_ar"] = base_spt / statistics.median(spt)
            per_prompt = [b / m for b, m in zip(seconds_per_token(per_method[baseline]), spt)]
            entry["speedup_per_prompt"] = per_prompt
            entry["speedup_worst_prompt"] = min(per_prompt)
            same = data.get("same_text")
            if same is not None:
                entry["same_text_as_ar"] = sum(same)
                base_equal = [b for b, keep in zip(seconds_per_token(per_method[baseline]), same) if keep]
                own_equal = [m for m, keep in zip(spt, same) if keep]
                entry["speedup_vs_ar_same_text"] = (statistics.median(base_equal) / statistics.median(own_equal)
                                                    if own_equal else None)
        if loaded_spt is not None:
            entry["speedup_vs_as_loaded"] = loaded_spt / statistics.median(spt)
        stats_list = data.get("stats_list")
        if stats_list:
            rounds = sum(s["rounds"] for s in stats_list)
            committed = sum(s["committed"] for s in stats_list)
            # Per position from the verified x accepted tables: a plain step (k = 0) or a round that verified
            # fewer drafts is no failed check of the positions it did not verify.
            width = max(len(s["verified_accepted"]) for s in stats_list)
            joint = [[sum(s["verified_accepted"][k][a] for s in stats_list if k < len(s["verified_accepted"])
                          and a < len(s["verified_accepted"][k])) for a in range(width)] for k in range(width)]
            entry["tau"] = committed / rounds if rounds else None
            entry["per_position_acceptance"] = SpeculativeStats.acceptance_by_position(joint)
            runs = len(stats_list) // entry["prompts"]  # the repeats of each prompt, in prompt order
            if runs and len(stats_list) == runs * entry["prompts"]:  # where a slow prompt loses: tau, draft share
                chunks = [stats_list[i : i + runs] for i in range(0, len(stats_list), runs)]
                entry["tau_per_prompt"] = [sum(s["committed"] for s in c) / max(1, sum(s["rounds"] for s in c))
                                           for c in chunks]
                entry["drafted_share_per_prompt"] = [
                    sum(s.get("draft_passes", 0) for s in c) / max(1, sum(s.get("verify_forwards", 0) for s in c))
                    for c in chunks]
            prefills = per_method[baseline].get("prefill_seconds") if baseline else None
            prefill = statistics.mean(prefills) if prefills else 0.0
            bound = speed_bound(stats_list, base_spt * batch_size, batch_size, prefill) if base_spt else None
            if bound is not None:
                bound["share_reached"] = entry["speedup_vs_ar"] / bound["bound"]
                entry["speed_bound"] = bound
        out[method] = entry
    return out


def _ratio(value) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def markdown_table(report: dict) -> str:
    lines = []
    for name, methods in report["datasets"].items():
        baseline = next((m for m, e in methods.items() if e.get("is_baseline")), None)
        lines.append(f"**{name}** ({next(iter(methods.values()))['prompts']} prompts, batch {report['settings']['batch_size']}, "
                     f"T={report['settings']['temperature']}, max {report['settings']['max_new_tokens']} new tokens"
                     + (f", the median of {repeats} interleaved runs per prompt"
                        if (repeats := report["settings"].get("repeats", 1)) > 1 else "") + ")"
                     + (f"; baseline: `{baseline}`, the fastest plain generate here" if baseline else "") + "\n")
        lines.append("| method | tau | tokens/s (median) | speedup | worst prompt | vs as loaded | c_d | v | bound "
                     "| with prefill | of bound | s/prompt median [min, max] | acceptance pos 1..4 | text = AR's "
                     "| speedup where text = AR's |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for method, e in methods.items():
            tau = f"{e['tau']:.2f}" if e.get("tau") else "-"
            accept = ", ".join(f"{a:.2f}" for a in (e.get("per_position_acceptance") or [])[:4]) or "-"
            same = f"{e['same_text_as_ar']}/{e['prompts']}" if "same_text_as_ar" in e else "-"
            bound = e.get("speed_bound")
            c_d, v, decode_limit, limit, share = (
                (f"{bound['c_d']:.2f}", f"{bound['v']:.2f}", _ratio(bound["decode_bound"]),
                 _ratio(bound["bound"]), f"{100 * bound['share_reached']:.0f} %") if bound else ("-",) * 5)
            lines.append(f"| {method}{' (baseline)' if e.get('is_baseline') else ''} | {tau} | "
                         f"{e['tokens_per_s_median']:.1f} | {_ratio(e.get('speedup_vs_ar'))} | "
                         f"{_ratio(e.get('speedup_worst_prompt'))} | {_ratio(e.get('speedup_vs_as_loaded'))} | "
                         f"{c_d} | {v} | {decode_limit} | {limit} | {share} | "
                         f"{e['seconds_per_prompt_median']:.2f} [{e['seconds_per_prompt_min']:.2f}, "
                         f"{e['seconds_per_prompt_max']:.2f}] | {accept} | {same} | {_ratio(e.get('speedup_vs_ar_same_text'))} |")
        lines.append("")
    lines.append("speedup: over the baseline, the fastest plain `generate` this machine has for the target in this "
                 "dtype (`ar`: as loaded, PyTorch's default linear kernel; `ar_onednn`: oneDNN with packed weights; "
                 "`ar_packed`: the packed grouped-query attention, the linear kernel chosen per forward), "
                 "measured in this process, interleaved. vs as loaded: over `ar`. c_d: a draft pass, v: the verifies "
                 "the loop chose, each over a plain step of the baseline; bound: tau / (c_d x drafted share + v), over the "
                 "decoding; with prefill: the same over a whole call, (P + D) / (P + D / bound), P the baseline's "
                 "prefill of the prompt and D its decoding; of bound: the speedup over the bound with prefill.")
    if report["skipped"]:
        lines.append("\nSkipped: " + "; ".join(f"`{m}`: {why}" for m, why in report["skipped"].items()))
    if report.get("target"):
        lines.append(f"\nTarget: {report['target']}.")
    machine = report.get("machine", {})
    if "dtype" in machine:
        lines.append(f"\nEvery method in {machine['dtype']}; the loops' linear kernel: "
                     f"{machine.get('linear_kernel', 'auto')} ({machine.get('processor') or 'CPU'}, "
                     f"{machine.get('threads')} threads).")
    lines.append(f"\nCommand: `{report['command']}`")
    return "\n".join(lines) + "\n"


def draw_chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["datasets"])
    methods = list(next(iter(report["datasets"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        taus = [report["datasets"][n][method].get("tau") or 0 for n in names]
        speed = [report["datasets"][n][method].get("speedup_vs_ar", 0) for n in names]
        xs = [j + i * width for j in range(len(names))]
        axes[0].bar(xs, taus, width, label=method)
        axes[1].bar(xs, speed, width, label=method)
    for ax, title in zip(axes, ["acceptance length tau", "speedup over the fastest plain generate"]):
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(names))], names)
        ax.set_title(title)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].legend(fontsize=8)
    settings = report["settings"]
    fig.suptitle(f"{report.get('target') or 'the target'}, batch {settings['batch_size']}, T={settings['temperature']}")
    fig.tight_layout()
    save_chart(fig, path, dpi=110)
    plt.close(fig)


def cmd_bench(args) -> int:
    import sys

    settings = from_args(BenchSettings, args)
    if args.profile:
        return print_cost_profile(settings)
    command_line = "hf-dflash2 " + " ".join(sys.argv[1:]) if sys.argv and "hf-dflash2" in sys.argv[0] else "hf-dflash2 bench"
    methods = with_every_baseline(settings.methods.split(","))
    refused = {m: refused_by_settings(m, settings.batch_size, settings.temperature > 0) for m in methods}
    if all(refused.values()):
        raise SystemExit(f"error: --methods {settings.methods}: none can run at --batch-size {settings.batch_size} "
                         f"and --temperature {settings.temperature:g}: "
                         + "; ".join(f"{m}: {why}" for m, why in refused.items()))
    output = writable_folder(settings.output)  # before hours of timing, not after
    chart = charts_available()
    if not chart:
        print("note: matplotlib is not installed (pip install 'hf_dflash2[plots]'): the bench writes its JSON and "
              "Markdown, no PNG chart", file=sys.stderr)
    report = run_benchmark(settings, command_line)
    stem = f"bench_b{settings.batch_size}_t{settings.temperature:g}"
    (output / f"{stem}.json").write_text(json.dumps(report, indent=1))
    table = markdown_table(report)
    (output / f"{stem}.md").write_text(table)
    if chart:
        draw_chart(report, output / f"{stem}.png")
    print(table)
    return 0


def writable_folder(path: str) -> Path:
    """``--output``: created if missing; refused by name if it is a file or cannot be written."""
    import os

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"error: --output {path} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SystemExit(f"error: --output {path}: cannot create it ({error.strerror})") from None
    if not os.access(folder, os.W_OK):
        raise SystemExit(f"error: --output {path}: this user cannot write there")
    return folder


def print_cost_profile(settings: BenchSettings) -> int:
    """``bench --profile``: the verify / draft costs the default loop starts from (``loop_cost_model``)."""
    from ..cpu.precision import load_target_for_decoding
    from ..generation.loop import loop_cost_model

    folder = bench_heads(settings).get("dflash2")
    if folder is None:
        raise SystemExit(f"--profile: --target {settings.target} has no committed dFlash 2 head; pass --head FOLDER")
    target, _ = load_target_for_decoding(settings.mixed_precision, settings.target, settings.gguf_file,
                                         settings.linear_kernel)
    check_head_matches_target(folder, target)
    head = load_head(folder, target)
    model = loop_cost_model(target, head, settings.batch_size, settings.linear_kernel)
    print(f"cost model ({model.key['device']}, {model.key['dtype']}, linear kernels {model.key['linear_kernel']}, "
          f"{model.key['attention']} attention, batch {settings.batch_size}, block {model.block_size}, "
          f"timed at a {model.key['context_length']}-token context):\n{model.table()}")
    return 0


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark decoding methods on MT-Bench / HumanEval prompts")
    add_arguments(bench, BenchSettings)
    add_arguments(bench, BenchCommand)
    bench.set_defaults(func=cmd_bench)
