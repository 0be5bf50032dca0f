"""An offline byte-level tokenizer for cards that embed their own weights.

A real Wan checkpoint ships UMT5's sentencepiece tokenizer; a card with seeded weights cannot download
one. Byte-level BPE with no merges maps any UTF-8 text onto 256 byte tokens plus T5's special tokens,
so the text path (tokenize -> encoder -> padded embeddings) is the real one, offline and deterministic.
It saves and loads through transformers like any other tokenizer (tokenizer.json).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2


def build_byte_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    # alphabet() comes back in hash order, which differs between calls: sort it, or the same text
    # would map to different ids in two engines.
    for byte_char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[byte_char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # T5 appends </s> to every sequence; keep that so the attention mask covers one extra token.
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )
