"""A llama.cpp context driven through llama-cpp-python's low-level (ctypes) API, fed token
ids directly: the engine of the `llama.cpp` benchmark peer (kvforge.tools.bench.llamacpp_peer).

Layout and invariants:
- `sequences` sequences, each in its own KV stream (`kv_unified` off: a sequence attends
  only its own cells) of `n_ctx_seq` >= `tokens_per_sequence` cells;
- a sequence's positions are 0, 1, ... in the order its tokens are fed;
- row i of the step batch always belongs to sequence i, so a step only rewrites the token
  and position arrays (numpy views of the batch's C buffers);
- logits are asked for each sequence's last fed token only, and the argmax is read from
  the batch index of that token (`llama_get_logits_ith`).
llama.cpp's log goes through a callback that drops everything below ERROR, so nothing is
printed while a timed region runs.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvforge.errors import KVForgeError

CELL_PAD = 256  # llama.cpp rounds each sequence's cells up to a multiple of this
GGML_LOG_ERROR, GGML_LOG_CONT = 4, 5  # ggml_log_level values (ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3)


def _forward_errors(level: int, text: bytes | None, user_data: Any) -> None:
    """Only errors reach stderr (a CONT piece continues the previous message's level)."""
    if level == GGML_LOG_CONT:
        level = _last_level[0]
    _last_level[0] = level
    if level == GGML_LOG_ERROR and text:
        print(text.decode("utf-8", "replace"), end="", file=sys.stderr, flush=True)


_last_level = [0]
_callback: Any = None  # the ctypes callback must outlive every llama.cpp call


def load_library() -> ModuleType:
    """llama_cpp with its log quietened and its backend initialised (idempotent)."""
    global _callback
    import llama_cpp

    if _callback is None:
        _callback = llama_cpp.llama_log_callback(_forward_errors)
        llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


def cells_per_sequence(tokens_per_sequence: int) -> int:
    return -(-tokens_per_sequence // CELL_PAD) * CELL_PAD


# --llama-cpp-flash-attn -> llama_context_params.flash_attn_type (llama.h: LLAMA_FLASH_ATTN_TYPE_*)
FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}
_FLASH_ATTN_NAMES = {value: name for name, value in FLASH_ATTN_TYPES.items()}


class Session:
    """One model and one context on the CPU; `close` (or `with`) frees them."""

    def __init__(self, path: Path, threads: int, sequences: int, tokens_per_sequence: int,
                 prompt_tokens: int, flash_attn: str = "auto") -> None:
        lib = self.lib = load_library()
        self.path, self.sequences = path, sequences
        self._model = self._ctx = None
        self._batches: list[Any] = []
        self._model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self._model:
            raise KVForgeError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_ctx = cells_per_sequence(tokens_per_sequence) * sequences
        params.n_batch = max(prompt_tokens, sequences)  # a whole prompt batch is one llama_decode call
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False  # one KV stream per sequence (llama.cpp's default)
        params.swa_full = False  # sliding-window layers keep their window only, as llama.cpp's tools do
        params.no_perf = True
        params.flash_attn_type = FLASH_ATTN_TYPES[flash_attn]
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            self.close()
            raise KVForgeError(f"llama.cpp could not create a context of {params.n_ctx} cells for {path}")
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self.settings = {
            "n_ctx": lib.llama_n_ctx(self._ctx), "n_ctx_seq": lib.llama_n_ctx_seq(self._ctx),
            "n_seq_max": sequences, "n_batch": lib.llama_n_batch(self._ctx), "n_ubatch": lib.llama_n_ubatch(self._ctx),
            "n_threads": threads, "n_threads_batch": threads, "kv_unified": False, "swa_full": False,
            "flash_attn": _FLASH_ATTN_NAMES[params.flash_attn_type]  # what llama.cpp was given
                          + (" (llama.cpp's default)" if params.flash_attn_type == FLASH_ATTN_TYPES["auto"] else ""),
            "kv_type": "f16 (llama.cpp's default)",
        }
        self._prompt = self._new_batch(max(prompt_tokens, 1))
        self._prompt_rows: list[int] = []  # batch index of each sequence's last prompt token
        self._step = self._new_batch(sequences)
        self._step_tokens = np.ctypeslib.as_array(self._step.token, shape=(sequences,))
        self._step_pos = np.ctypeslib.as_array(self._step.pos, shape=(sequences,))
        for row in range(sequences):  # row i is sequence i, one token each, logits for all
            self._step.n_seq_id[row] = 1
            self._step.seq_id[row][0] = row
            self._step.logits[row] = 1
        self._step.n_tokens = sequences

    def _new_batch(self, capacity: int) -> Any:
        batch = self.lib.llama_batch_init(capacity, 0, 1)
        self._batches.append(batch)
        return batch

    def model_description(self) -> str:
        buffer = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self._model, buffer, len(buffer))
        return buffer.value.decode("utf-8", "replace")

    def clear(self) -> None:
        """Forget every sequence's cells (data too)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self._ctx), True)

    def load_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Write the prompts into the prompt batch: prompt i is sequence i from position 0,
        logits on its last token. Untimed work (a Python loop over every token)."""
        if len(prompts) > self.sequences:
            raise KVForgeError(f"{len(prompts)} prompts for a context of {self.sequences} sequences")
        batch, rows, index = self._prompt, [], 0
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                batch.token[index], batch.pos[index] = token, pos
                batch.n_seq_id[index], batch.seq_id[index][0] = 1, seq
                batch.logits[index] = 1 if pos == len(prompt) - 1 else 0
                index += 1
            rows.append(index - 1)
        batch.n_tokens = index
        self._prompt_rows = rows

    def run_prompts(self) -> list[int]:
        """One llama_decode of the loaded prompts; each sequence's greedy next token."""
        self._decode(self._prompt)
        return self._argmax(self._prompt_rows)

    def step(self, tokens: Sequence[int], position: int) -> list[int]:
        """One lock-step decode call: token i at `position` of sequence i; greedy next tokens."""
        self._step_tokens[:] = tokens
        self._step_pos[:] = position
        self._decode(self._step)
        return self._argmax(range(self.sequences))

    def _decode(self, batch: Any) -> None:
        status = self.lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise KVForgeError(f"llama_decode returned {status} (1: no KV cells left, < 0: error)")

    def _argmax(self, rows: Sequence[int]) -> list[int]:
        out = []
        for row in rows:
            pointer = self.lib.llama_get_logits_ith(self._ctx, row)
            if not pointer:
                raise KVForgeError(f"llama.cpp has no logits for batch row {row}")
            out.append(int(np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).argmax()))
        return out

    def close(self) -> None:
        for batch in self._batches:
            self.lib.llama_batch_free(batch)
        self._batches = []
        if self._ctx:
            self.lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self.lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
