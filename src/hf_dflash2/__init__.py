"""dFlash 2 speculative decoding for Hugging Face Transformers."""

from .attention import PACKED_GQA_SDPA, packed_gqa_attention
from .configuration_dflash2 import DFlash2Config
from .generation import SpeculativeOutput, speculative_generate
from .linear_kernels import use_linear_kernel
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
