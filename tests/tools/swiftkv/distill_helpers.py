"""Tiny teachers, data and recipes for the distillation tests.

No transformers import here (unlike conftest): the data-parallel test spawns processes that
import this module, and a light import keeps that test fast."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvforge.config import ModelConfig, RopeConfig, SwiftKVConfig
from kvforge.models.registry import build_model
from kvforge.tools.swiftkv.data import PackedData, Sample, pack
from kvforge.tools.swiftkv.recipe import DistillRecipe
from kvforge.tools.swiftkv.student import DistillModel

VOCAB = 96
FIRST_LATER, GROUP = 1, 2  # on the 5-layer base of across_kv_pair: AcrossKV groups of 2


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls are faster on one thread (and immune to a busy machine's other jobs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_base(seed: int = 4):
    """A 5-layer GQA llama with random weights (norms around 1)."""
    config = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=5,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024,
                         rope=RopeConfig(theta=10000.0))
    model = build_model(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale, offset = (0.1, 1.0) if "norm" in name else (0.2, 0.0)
            p.copy_(torch.randn(p.shape, generator=generator) * scale + offset)
    return model


def tiny_distill_model(first_later: int = FIRST_LATER, group: int = GROUP,
                       train_later_layers: bool = False, activation_checkpointing: bool = False) -> DistillModel:
    return DistillModel(tiny_base(), SwiftKVConfig(first_later, group), train_later_layers,
                        activation_checkpointing=activation_checkpointing)


def random_samples(count: int, seed: int, chat_like: bool = False) -> list[Sample]:
    """Random token samples of varied length; chat-like ones count only their second half."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = int(torch.randint(5, 40, (1,), generator=generator))
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        counted = [t >= length // 2 - 1 and t < length - 1 for t in range(length)] if chat_like else [True] * length
        samples.append(Sample(ids, counted))
    return samples


def random_data(rows_wanted: int = 12, seq_len: int = 16, seed: int = 0) -> PackedData:
    """Packed text-like data with segment boundaries inside rows and some uncounted positions."""
    samples = random_samples(rows_wanted * 2, seed, chat_like=True)
    data = pack(samples, seq_len, pad_id=0, split=False)
    assert data.num_rows >= rows_wanted
    index = torch.arange(rows_wanted)
    return PackedData(*data.rows(index), "random")


def tiny_recipe(out, **overrides) -> DistillRecipe:
    values = dict(model="tiny", num_key_value_layers=FIRST_LATER, group_size=GROUP, out=str(out), seq_len=16,
                  micro_batch_size=2, grad_accum=2, max_steps=6, save_every=2, learning_rate=1e-2,
                  warmup_ratio=0.2, seed=3)
    values.update(overrides)
    return DistillRecipe(**values)


def write_tiny_hf_checkpoint(directory: Path) -> Path:
    """A tiny llama in HF format carrying SmolLM2's tokenizer (hence its 49152-token vocab);
    skips the test when that tokenizer is not installed."""
    from kvforge.models.loader import resolve_model_source
    from kvforge.models.swiftkv_checkpoint import write_checkpoint
    from kvforge.models.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(resolve_model_source("smollm2-135m"))
    except Exception as exc:  # the named model is an optional local install
        pytest.skip(f"smollm2-135m tokenizer unavailable: {exc}")
    config = ModelConfig(architecture="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                         max_position_embeddings=512, rope=RopeConfig(theta=10000.0), tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_ids=(tokenizer.eos_token_id,))
    model = build_model(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.1 if "norm" in name else 0.3)
                    + (1.0 if "norm" in name else 0.0))
    write_checkpoint(directory, config, model.state_dict(), torch.float32)
    tokenizer.save_pretrained(str(directory))
    return directory


def text_file(path: Path) -> Path:
    """Ten small articles with WikiText-style titles (so the train/held-out split applies)."""
    rng = random.Random(0)
    words = "the a river city old new north south king music team song film year war early large".split()
    articles = []
    for n in range(10):
        body = "\n".join(" ".join(rng.choice(words) for _ in range(40)) + " ." for _ in range(4))
        articles.append(f" = Article {n} = \n\n{body}\n")
    path.write_text("".join(articles))
    return path


class Interrupted(Exception):
    """Raised by `train_tiny` after `interrupt_after` steps: a run killed mid-way."""


def train_tiny(model: DistillModel, recipe: DistillRecipe, parallel=None, interrupt_after: int | None = None):
    """Train `model` on `random_data()`; returns (trainer, records of the steps run), records
    None when interrupted after step `interrupt_after`."""
    from kvforge.tools.swiftkv.trainer import Trainer

    trainer = Trainer(model, random_data(), recipe, recipe.out, parallel, progress=False)

    def stop(step, record):
        if step == interrupt_after:
            raise Interrupted

    try:
        records = trainer.train(on_step=stop)
    except Interrupted:
        records = None
    return trainer, records


def parameter_owners(model: DistillModel) -> tuple[dict[int, int], set[int], set[int]]:
    """(how many units hold each parameter id, the ids the stack itself holds (embedding,
    final norm, head), the ids of every teacher and student parameter): what FSDP shards."""
    stack = model.stack
    owners: dict[int, int] = {}
    for unit in [*stack.units, stack.swiftkv_inputs]:
        for p in set(unit.parameters()):
            owners[id(p)] = owners.get(id(p), 0) + 1
    rest = {id(p) for m in (stack.embed_tokens, stack.norm, stack.lm_head) for p in m.parameters()}
    every = {id(p) for p in model.teacher.parameters()} | {id(p) for p in model.student.parameters()}
    return owners, rest, every


def check_teacher_and_student(model: DistillModel, reference: torch.nn.Module) -> None:
    """The distillation forward's teacher is the base model's dense forward and its student
    `reference`'s (the initialised SwiftKV model), on packed random rows; the re-wiring does
    change the student."""
    from kvforge.models.dense import dense_hidden_states

    data = random_data()
    tokens, segments = data.tokens[:2], data.segments[:2]
    with torch.no_grad():
        pair = model.forward_hidden(tokens, segments)
        torch.testing.assert_close(pair.teacher, dense_hidden_states(model.teacher, tokens, segments),
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(pair.student, dense_hidden_states(reference, tokens, segments), atol=1e-6, rtol=0)
        assert (pair.student - pair.teacher).abs().max() > 1e-3
