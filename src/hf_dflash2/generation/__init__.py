"""The public API and the fast speculative loop.

- ``loop.py``: ``speculative_generate`` and the round loop, ``speculative_decode``, where a round reads top to
  bottom: propose -> plan -> verify -> accept -> commit;
- ``config.py``: the settings a call decodes with (``generate``'s precedence) and the checks on its inputs;
- ``processors.py``: ``generate``'s logits processors at every verified slot;
- ``sampling.py``: the target's token choice and the acceptance rule;
- ``outputs.py``: ``SpeculativeOutput`` and the buffers a round writes;
- ``trees.py``: draft trees, the head's likeliest continuations verified in one forward.

The drafting, the policy and the cost model live in the remote-code set beside this package
(``speculative_dflash2.py``, ``cost_model_dflash2.py``), which a saved head carries.
"""

from .config import (
    PLAIN_GREEDY,
    PROCESSED_SETTINGS,
    UNSUPPORTED_GENERATION_SETTINGS,
    resolve_generation_config,
)
from .loop import loop_cost_model, loop_forwards, prefill, speculative_decode, speculative_generate, verify
from .outputs import SpeculativeOutput
from .processors import TargetLogitsProcessors, apply_repetition_penalty

__all__ = [
    "PLAIN_GREEDY",
    "PROCESSED_SETTINGS",
    "UNSUPPORTED_GENERATION_SETTINGS",
    "SpeculativeOutput",
    "TargetLogitsProcessors",
    "apply_repetition_penalty",
    "loop_cost_model",
    "loop_forwards",
    "prefill",
    "resolve_generation_config",
    "speculative_decode",
    "speculative_generate",
    "verify",
]
