"""A KV budget the machine cannot hold is a configuration error naming `kv_budget`, never an
allocator's traceback: on the command line and in `LLM` it is refused before any weights
load (on the CPU: more than this machine's RAM and swap), and a cache built directly whose
stores cannot be allocated says so (the one real allocation tried here is beyond any address
space, in pages so large that its page list stays small)."""

from __future__ import annotations

import pytest
import torch

from kvforge.cache import registry
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.errors import ConfigError
from kvforge.sizes import check_host_budget, host_memory_bytes

LAYOUT = CacheLayout.one_per_layer([CacheLayerSpec(3, 64, 64 ** -0.5)] * 4)


def test_a_host_budget_above_ram_and_swap_is_refused_and_one_below_is_kept(monkeypatch):
    monkeypatch.setattr("kvforge.sizes.host_memory_bytes", lambda: 2**30)
    assert check_host_budget("512MiB") == 2**29
    assert check_host_budget("1GiB") == 2**30
    with pytest.raises(ConfigError, match=r"invalid kv_budget='1.5GiB': must fit in this machine's memory"):
        check_host_budget("1.5GiB")


def test_this_machine_reports_its_memory_and_swap_counts(tmp_path):
    memory = host_memory_bytes()
    assert memory is not None and memory > 2**30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nSwapTotal:       2048 kB\nSwapFree:       2048 kB\n")
    assert host_memory_bytes(str(meminfo)) - host_memory_bytes(str(tmp_path / "none")) == 2048 * 1024


@pytest.mark.parametrize(("typed", "extra", "refused"), [
    (True, {}, True),
    (False, {}, False),  # a verb's default: untouched pages cost no RAM, bench's 4GiB must run anywhere
    (True, {"device_kind": "cuda"}, False),  # device memory: the allocation is the check there
    (True, {"base_url": "http://127.0.0.1:9"}, False),  # bench serve against a server it does not start
])
def test_only_a_typed_host_budget_is_checked_against_the_machine(monkeypatch, typed, extra, refused):
    from argparse import Namespace

    from kvforge.cli_checks import check_typed_host_budget

    monkeypatch.setattr("kvforge.sizes.host_memory_bytes", lambda: 2**30)
    args = Namespace(kv_budget="1GiB,4GiB", typed_options=frozenset({"--kv-budget"} if typed else ()), **extra)
    if refused:
        with pytest.raises(ConfigError, match="kv_budget='4GiB'"):
            check_typed_host_budget(args)
    else:
        check_typed_host_budget(args)


def _failing_entry(monkeypatch, method) -> None:
    """Every cache method name builds with `method` (a stand-in that raises)."""
    config = registry._entry("full").config
    monkeypatch.setattr(registry, "_entry", lambda name: registry._Entry(method, config))


@pytest.mark.parametrize("error", [RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                                                "allocate 5000000000000 bytes"),
                                   torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 60.00 GiB"),
                                   RuntimeError("CUDA error: out of memory"),  # e.g. pinning host memory
                                   MemoryError()])
def test_an_allocation_failure_while_building_a_cache_names_the_budget(monkeypatch, error):
    def failing(*args, **kwargs):
        raise error

    _failing_entry(monkeypatch, failing)
    with pytest.raises(ConfigError, match=r"invalid kv_budget='2.00 TiB': could not be allocated on cpu"):
        registry.create_cache("full", LAYOUT, 2 * 2**40, torch.float32)


@pytest.mark.parametrize("message", ["a bug, not memory", "could not allocate a stream: not a memory error"])
def test_other_runtime_errors_of_a_cache_pass_through(monkeypatch, message):
    def failing(*args, **kwargs):
        raise RuntimeError(message)

    _failing_entry(monkeypatch, failing)
    with pytest.raises(RuntimeError, match=message):
        registry.create_cache("full", LAYOUT, 2**20, torch.float32)


def test_a_full_cache_beyond_any_address_space_fails_in_its_stores_as_a_config_error():
    # 1 PiB, which no machine maps, in 4 GiB pages: the page list stays small whatever fails first.
    wide = CacheLayout.one_per_layer([CacheLayerSpec(8, 256, 256 ** -0.5)] * 4)
    with pytest.raises(ConfigError, match="kv_budget.*could not be allocated on cpu"):
        registry.create_cache("full:block_size=65536,decode_tile_tokens=65536", wide, 2**50, torch.float32)


def test_llm_refuses_a_host_budget_before_loading(monkeypatch):
    from kvforge.engine.llm import LLM

    def never(*args, **kwargs):
        raise AssertionError("the weights loaded before the budget was checked")

    monkeypatch.setattr("kvforge.engine.llm.load_model", never)
    monkeypatch.setattr("kvforge.sizes.host_memory_bytes", lambda: 2**30)
    with pytest.raises(ConfigError, match="kv_budget.*this machine's memory"):
        LLM("llama-tiny", load_format="dummy", kv_budget="2GiB", dtype="float32")
