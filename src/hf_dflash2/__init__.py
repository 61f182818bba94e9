"""dFlash 2 speculative decoding for Hugging Face Transformers.

Layout. The ``*_dflash2.py`` files here are the remote code a saved head carries (``save_pretrained`` copies
the modeling file and every sibling it imports): they stay flat, import one another only as
``from .sibling import X`` and nothing else of this package (``tests/test_layout.py`` checks both). The rest
is laid out by responsibility: ``generation/`` the public API and the fast loop (``generation/loop.py``:
where a round happens), ``cpu/`` kernels, precision, attention and the allocator, ``evaluation/`` the bench,
``cli/`` the ``hf-dflash2`` command, ``training/`` heads from data, ``hub.py`` publishing. No module imports
another that imports it back.
"""

from .cpu.attention import PACKED_GQA_SDPA, packed_gqa_attention
from .configuration_dflash2 import DFlash2Config
from .generation import SpeculativeOutput, speculative_generate
from .cpu.linear_kernels import use_linear_kernel
from .modeling_dflash2 import DFlash2DraftModel, DFlashDraftModel
from .candidate_generator_dflash2 import DFlash2CandidateGenerator
from .speculative_dflash2 import SpeculativeStats

__version__ = "0.2.0"

__all__ = [
    "PACKED_GQA_SDPA",
    "DFlash2Config",
    "DFlash2DraftModel",
    "DFlashDraftModel",
    "DFlash2CandidateGenerator",
    "SpeculativeOutput",
    "SpeculativeStats",
    "packed_gqa_attention",
    "speculative_generate",
    "use_linear_kernel",
]
