"""The demo models' character tokenizer: one token per character, built in memory with `tokenizers`.

Owns the vocabulary (`<pad>` 0, `<eos>` 1, then `CHARACTERS`, or `CALC_CHARACTERS` for the calculator task),
`build_char_tokenizer`, and `build_byte_tokenizer` (every byte: the chat model of bench/cookbook_recipes.py).
Imports neither torch nor the model classes, so checking a dataset against the demo model's tokenizer
(`cluster.run.data`) does not load them; the models themselves are cluster/demo/model.py's.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
CHARACTERS = "0123456789+-*= "
CALC_CHARACTERS = CHARACTERS + "[]"  # appended: the other characters keep their ids


def build_char_tokenizer(model_max_length: int = 64, characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """One token per character of `characters` (id 2 + its index); `<pad>` is id 0, `<eos>` id 1; no BOS, nothing
    added on encode. The calc task's tokenizer has `CALC_CHARACTERS`, the others `CHARACTERS`.

    Built as a byte-level BPE without merges because transformers reloads any qwen2 model directory with
    `Qwen2Tokenizer`, which rebuilds a byte-level BPE from the saved vocabulary and merges (a character-level
    WordLevel tokenizer would silently lose its spaces). The space is therefore stored as byte-level "Ġ", and
    `unk_token` is saved as null so the reload adds no `<|endoftext|>`. Characters outside the vocabulary are
    dropped on encode, by this tokenizer and by the reloaded one alike.
    """
    byte_level = pre_tokenizers.ByteLevel.alphabet()  # printable stand-ins for bytes, e.g. " " -> "Ġ"
    if len(set(characters)) != len(characters) or not all(char in byte_level or char == " " for char in characters):
        raise ValueError(f"characters {characters!r} must be distinct and printable ASCII (or the space)")
    return _byte_level_tokenizer(["Ġ" if char == " " else char for char in characters], model_max_length)


def build_byte_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """One token per byte (any text: a chat model's, tinker-cookbook's renderers'); `<pad>` is id 0, `<eos>` id 1,
    then the 256 bytes' byte-level stand-ins in sorted order. Reloads as `build_char_tokenizer`'s does."""
    return _byte_level_tokenizer(sorted(pre_tokenizers.ByteLevel.alphabet()), model_max_length)


def _byte_level_tokenizer(symbols: list[str], model_max_length: int) -> PreTrainedTokenizerFast:
    """`<pad>` 0, `<eos>` 1, then `symbols` (byte-level stand-ins) from id 2: a byte-level BPE without merges."""
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1} | {symbol: 2 + i for i, symbol in enumerate(symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(PAD_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
