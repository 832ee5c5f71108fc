"""HF ``transformers`` adapter: LATTE in any attention module that dispatches through
``ALL_ATTENTION_FUNCTIONS`` (ViT, CLIP, BERT/RoBERTa, RT-DETR, ...). See :mod:`.attention`."""
from .attention import LATTE_IMPLEMENTATION, install_latte, is_hf_attention, latte_attention_forward

__all__ = ["LATTE_IMPLEMENTATION", "install_latte", "is_hf_attention", "latte_attention_forward"]
