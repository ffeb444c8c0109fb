"""The transformers peer hands its prompts to the model on the model's device (a stand-in
model records where its input ids are; a GPU peer fed CPU ids would fail)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvforge.tools.bench import hf_peer


class RecordingPeer(torch.nn.Module):
    """Answers like a transformers causal LM on `device` and records its inputs' devices."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.generation_config = SimpleNamespace(pad_token_id=0, eos_token_id=None)
        self.seen: list[torch.device] = []

    def forward(self, input_ids: torch.Tensor, **kwargs) -> SimpleNamespace:
        self.seen.append(input_ids.device)
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 8, device=self.device))

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 **kwargs) -> torch.Tensor:
        self.seen += [input_ids.device, attention_mask.device]
        return torch.zeros(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, device=self.device)


def test_prefill_and_generate_put_the_prompt_ids_on_the_models_device():
    peer = RecordingPeer("meta")
    hf_peer.prefill(peer, [[5, 6, 7], [8, 9, 10]])
    hf_peer.generate(peer, [[5, 6, 7], [8, 9, 10]], output_len=2, batch=1)
    assert peer.seen and all(device == torch.device("meta") for device in peer.seen)


def test_the_peer_of_a_gguf_file_asks_for_dequantized_weights(monkeypatch):
    """Recent transformers keep GGUF weights packed when the `kernels` package has a matmul
    kernel for the device (a GPU machine may): the peer would then run other arithmetic than
    kvforge, so it asks for the dense weights whatever is installed."""
    import transformers

    from kvforge.models.loader import resolve_model_source
    from kvforge.tools.verify import load_transformers_model

    source = resolve_model_source("smollm2-135m")
    assert source.kind == "gguf"
    asked: dict = {}

    def from_pretrained(path, **kwargs):
        asked.update(kwargs)
        return RecordingPeer("cpu")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    load_transformers_model(source, "cpu", torch.bfloat16)
    assert asked["gguf_file"] == source.path.name and asked["quantization_config"].dequantize is True
