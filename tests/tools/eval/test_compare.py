"""Parsing of --cache/--compare into evaluated systems and the choice of the baseline."""

from __future__ import annotations

import pytest

from kvforge.errors import ConfigError
from kvforge.tools.eval.compare import (
    HFKIVIOptions,
    HFQuantizedOptions,
    baseline_index,
    parse_system,
    parse_systems,
    split_entries,
)


def test_split_entries_keeps_spec_options_together():
    assert split_entries(["full,hf", "hf-quanto:bits=2,group=64,full:storage_dtype=bfloat16,block_size=8"]) == [
        "full", "hf", "hf-quanto:bits=2,group=64", "full:storage_dtype=bfloat16,block_size=8"]
    assert split_entries("hf-kivi,bits=4") == ["hf-kivi:bits=4"]
    assert split_entries(None) == []


def test_parse_hf_systems_with_options():
    quanto = parse_system("hf-quanto:bits=2,residual=64")
    assert quanto.kind == "hf" and quanto.hf_cache == "quanto"
    assert quanto.hf_options == HFQuantizedOptions(bits=2, group=32, residual=64)
    assert quanto.name == "hf-quanto:bits=2,residual=64"
    assert parse_system("hf-kivi").hf_options == HFKIVIOptions()
    assert parse_system("hf").hf_cache == "dynamic"


@pytest.mark.parametrize("entry,match", [("hf-foo", "hf-quanto"), ("hf:bits=2", "no options"),
                                         ("hf-quanto:nbits=2", "known options"), ("hf-kivi:bits=3", "bits"),
                                         ("nosuchcache", "cache spec"), ("base", "swiftkv")])
def test_bad_entries_fail_with_the_rule(entry: str, match: str):
    with pytest.raises(ConfigError, match=match):
        parse_system(entry)


def test_baseline_is_first_full_precision_comparison():
    systems = parse_systems("full:storage_dtype=bfloat16", [], ["full:storage_dtype=float16,hf,full"])
    assert [s.name for s in systems] == ["kvforge[full:storage_dtype=bfloat16]",
                                         "kvforge[full:storage_dtype=float16]", "hf", "kvforge[full]"]
    assert baseline_index(systems) == 2
    assert baseline_index(systems, "full") == 3
    assert baseline_index(parse_systems("full", [], [])) == 0
    assert baseline_index(parse_systems("full", [], ["full:storage_dtype=bfloat16"])) == 0
    assert baseline_index(parse_systems("kivi:bits=2", [], ["hf-quanto:bits=2"])) == 1
    with pytest.raises(ConfigError, match="baseline"):
        baseline_index(systems, "nope")


def test_baseline_named_by_spec_or_display_name():
    systems = parse_systems("shadowkv", [], ["full,shadowkv:rank=64,shadowkv"])
    assert baseline_index(systems, "shadowkv") == 0  # the first system with that spec
    assert baseline_index(systems, "kvforge[shadowkv]#2") == 3
    assert baseline_index(systems, "shadowkv:rank=64") == 2
    assert baseline_index(systems, "kvforge[full]") == 1


def test_duplicate_systems_get_distinct_names():
    names = [s.name for s in parse_systems("full", [], ["full,hf,hf"])]
    assert names == ["kvforge[full]", "kvforge[full]#2", "hf", "hf#2"]


def test_swiftkv_systems_and_base():
    systems = parse_systems("full", [], ["base,hf,kivi:bits=4"], swiftkv="ckpt")
    assert [s.name for s in systems] == ["swiftkv[full]", "base[full]", "hf", "swiftkv[kivi:bits=4]"]
    assert [s.swiftkv for s in systems] == [True, False, True, True]
    assert baseline_index(systems) == 1  # the base model with the full cache
    with pytest.raises(ConfigError, match="--swiftkv"):
        parse_systems("full", [], ["base"])
