"""A Llama-style tokenizer llguidance can read (leading-space marker, byte fallback for any
other character) and a tiny random model over its vocabulary: what the structured-output
tests run on (the character tokenizer of server_helpers has a decoder llguidance does not
read)."""

from __future__ import annotations

import torch
import transformers
from server_helpers import CHAT_TEMPLATE, CONTEXT
from tokenizers import Tokenizer, decoders, models, normalizers

from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.registry import build_model

WORDS = ["▁", *"abcdefghijklmnopqrstuvwxyz0123456789{}[]\":,-", "▁yes", "▁no", "ye", "yes", "no", "yellow",
         "true", "false", "null", "\"a\"", "\"b\""]
VOCAB = 320


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """<unk>=0, <s>=1, </s>=2 (EOS), the 256 byte tokens <0x00>..<0xFF>, then WORDS."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    assert len(vocab) <= VOCAB
    model = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def byte_model(seed: int = 0) -> torch.nn.Module:
    hf_config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                         max_position_embeddings=CONTEXT, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = build_model(config_from_hf_dict(hf_config.to_dict()), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.3)
    return model.eval()
