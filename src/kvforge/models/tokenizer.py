"""Tokenizers through Hugging Face transformers, strictly offline.

Only local paths are passed (the GGUF file's directory plus its file name, or the
checkpoint directory) with `local_files_only=True`, so nothing is ever fetched from a hub.
For GGUF files transformers rebuilds a fast tokenizer from the embedded vocabulary and
chat template (`tokenizer.chat_template`), and honours `tokenizer.ggml.add_bos_token`.

That GGUF conversion is slow, the more so the larger the vocabulary, so the converted
tokenizer is saved once with `save_pretrained` and reloaded from there, which is faster
(docs/benchmarks.md#measurements-behind-design-choices). The cache key covers the file
(resolved path, size, mtime) and the transformers version, which owns the conversion; the
round trip was checked to give identical ids, special tokens and chat template on both real
models. Location: $KVFORGE_CACHE_DIR/tokenizers, else ~/.cache/kvforge/tokenizers. Any cache
failure falls back to converting from the GGUF file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvforge.errors import ModelLoadError
from kvforge.models.loader import ModelSource
from kvforge.user_cache import user_cache_dir

logger = logging.getLogger(__name__)

Message = Mapping[str, str]


def tokenizer_cache_dir() -> Path:
    return user_cache_dir("tokenizers")


def _cache_entry(gguf_path: Path) -> Path:
    import transformers

    resolved = gguf_path.resolve()
    stat = resolved.stat()
    digest = hashlib.sha1(str(resolved).encode("utf-8")).hexdigest()[:12]
    key = f"{resolved.stem}-{digest}-{stat.st_size}-{stat.st_mtime_ns}-tf{transformers.__version__}"
    return tokenizer_cache_dir() / key


def load_tokenizer(source: ModelSource, cache: bool = True) -> Any:
    """A transformers tokenizer for `source`; GGUF conversions are cached unless cache=False."""
    from transformers import AutoTokenizer

    try:
        if source.kind == "hf_dir":
            return AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
        entry = _cache_entry(source.path) if cache else None
        if entry is not None and entry.is_dir():
            try:
                return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
            except (OSError, ValueError, KeyError) as exc:  # damaged entry: rebuild it
                logger.warning("ignoring tokenizer cache %s: %s", entry, exc)
                shutil.rmtree(entry, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                  local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {source.path}: {exc}") from exc
    if entry is not None:
        _save_to_cache(tokenizer, entry)
    return tokenizer


def _save_to_cache(tokenizer: Any, entry: Path) -> None:
    """Write atomically (temp dir + rename) so a concurrent reader never sees half an entry."""
    tmp: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, entry)
        tmp = None
    except OSError as exc:  # read-only home, a concurrent writer won the rename, ...
        logger.info("tokenizer cache not written (%s): %s", entry, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


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


def encode_prompt(tokenizer: Any, text_or_messages: str | Sequence[Message], chat: bool,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a prompt.

    chat=True and the tokenizer has a chat template: the template with the generation prompt
    appended (the template itself places BOS where the model expects it). Otherwise plain
    encoding with the tokenizer's own special-token behaviour (adds BOS only if the model
    was trained that way, e.g. Gemma yes, SmolLM2 no); messages are then joined as text.
    `tools` (OpenAI's function list) go to the template, for one that shows them.
    """
    if chat and has_chat_template(tokenizer):
        extra = {"tools": tools} if tools else {}
        ids = tokenizer.apply_chat_template(_as_messages(text_or_messages), add_generation_prompt=True,
                                            tokenize=True, **extra)
        return _to_int_list(ids)
    return _to_int_list(tokenizer.encode(_as_text(text_or_messages)))
