"""From step records to what trainers consume: token ids with provenance, checks, tensors, exports."""

from .render import Rendered, Renderer, load_tokenizer
from .tokenize_steps import TokenizeReport, tokenize_steps

__all__ = ["Rendered", "Renderer", "load_tokenizer", "TokenizeReport", "tokenize_steps"]
