"""Tokenizers through Hugging Face transformers, strictly offline.

Only local paths are passed (the GGUF file's directory plus its file name, or the
checkpoint directory) with `local_files_only=True`, so nothing is ever fetched from a hub.
For GGUF files transformers rebuilds a fast tokenizer from the embedded vocabulary and
chat template (`tokenizer.chat_template`), and honours `tokenizer.ggml.add_bos_token`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvforge.errors import ModelLoadError
from kvforge.models.loader import ModelSource

Message = Mapping[str, str]


def load_tokenizer(source: ModelSource) -> Any:
    """A transformers tokenizer for `source` (PreTrainedTokenizerFast in practice)."""
    from transformers import AutoTokenizer

    try:
        if source.kind == "gguf":
            return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                 local_files_only=True)
        return AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {source.path}: {exc}") from exc


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _as_messages(text_or_messages: str | Sequence[Message]) -> list[dict[str, str]]:
    if isinstance(text_or_messages, str):
        return [{"role": "user", "content": text_or_messages}]
    return [dict(message) for message in text_or_messages]


def _as_text(text_or_messages: str | Sequence[Message]) -> str:
    """Plain-text fallback for messages when no chat template applies: contents joined by lines."""
    if isinstance(text_or_messages, str):
        return text_or_messages
    return "\n".join(str(message["content"]) for message in text_or_messages)


def _to_int_list(ids: Any) -> list[int]:
    """Normalise what tokenizers return (list, nested list, tensor, BatchEncoding) to list[int]."""
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]  # transformers 5: apply_chat_template may return a BatchEncoding
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one
        if len(ids) != 1:
            raise ValueError(f"expected one sequence of token ids, got {len(ids)}")
        ids = ids[0]
    return [int(i) for i in ids]


def encode_prompt(tokenizer: Any, text_or_messages: str | Sequence[Message], chat: bool) -> list[int]:
    """Token ids of a prompt.

    chat=True and the tokenizer has a chat template: the template with the generation prompt
    appended (the template itself places BOS where the model expects it). Otherwise plain
    encoding with the tokenizer's own special-token behaviour (adds BOS only if the model
    was trained that way, e.g. Gemma yes, SmolLM2 no); messages are then joined as text.
    """
    if chat and has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template(_as_messages(text_or_messages), add_generation_prompt=True,
                                            tokenize=True)
        return _to_int_list(ids)
    return _to_int_list(tokenizer.encode(_as_text(text_or_messages)))
