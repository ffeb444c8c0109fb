"""Hypothesis strategies of bad values, one per kind of option (cli_walk.option_kind), and a
scratch directory holding the files and directories they name.

Two tiers. `invalid_value` draws values that no option of that kind accepts (wrong type,
NaN, negative counts, a value outside the choices, a missing or wrong file): the command
must refuse them, exit 2 and name the option. `edge_value` draws values an option may accept
or refuse (zero, huge, infinity, an empty text file): the command must either refuse them
cleanly or go on to its work, never crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

KNOWN_DTYPES = {"float32", "fp32", "bfloat16", "bf16", "float16", "fp16"}


@dataclass(frozen=True)
class Scratch:
    """Files the drawn values name, written once per test into a fresh directory."""

    root: Path

    @property
    def afile(self) -> Path:  # a regular file where a directory is wanted
        return self.root / "a-file.txt"

    @property
    def adir(self) -> Path:  # a directory where a file is wanted
        return self.root / "a-dir"

    def model_dir(self, name: str) -> Path:
        return self.root / "models" / name

    def write(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.afile.write_text("not a directory\n")
        self.adir.mkdir(exist_ok=True)
        (self.root / "empty.txt").write_text("")
        broken = {
            "empty-dir": None,  # a directory without config.json
            "config-not-json": "{\"model_type\": \"llama\", ",
            "config-a-list": "[1, 2, 3]",
            "config-partial": "{\"model_type\": \"llama\", \"hidden_size\": 64}",
            "config-no-weights": ("{\"model_type\": \"llama\", \"vocab_size\": 64, \"hidden_size\": 32, "
                                  "\"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
                                  "\"num_key_value_heads\": 2, \"max_position_embeddings\": 256}"),
        }
        for name, config in broken.items():
            directory = self.model_dir(name)
            directory.mkdir(parents=True, exist_ok=True)
            if config is not None:
                (directory / "config.json").write_text(config)
        (self.root / "models" / "garbage.gguf").write_bytes(b"\x00\x01not a gguf file" * 8)
        (self.root / "models" / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05")

    def files(self) -> set[Path]:
        return set(self.root.rglob("*"))


def _ints_text(low: int | None = None, high: int | None = None) -> st.SearchStrategy[str]:
    return st.integers(min_value=low, max_value=high).map(str)


def _not_a_number() -> st.SearchStrategy[str]:
    # not "--": argparse reads `--flag=--` as an empty list, before any type= validator
    return st.one_of(st.sampled_from(["abc", "", " ", "one", "1,5", "0x10", "-", "None"]),
                     st.text(alphabet="abcxyz_!?", min_size=1, max_size=6))


def invalid_value(kind: str, option, scratch: Scratch) -> st.SearchStrategy[str]:
    """Values no option of `kind` accepts."""
    root = scratch.root
    if kind == "int":
        return st.one_of(_not_a_number(), st.sampled_from(["1.5", "nan", "inf", "-inf", "1e3"]),
                         _ints_text(high=-1))
    if kind == "float":
        return st.one_of(_not_a_number(), st.sampled_from(["nan", "-nan", "-inf"]),
                         st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False).map(repr))
    if kind == "int_list":
        return st.one_of(st.sampled_from(["a,b", "1.5", "1,x"]),
                         st.lists(st.integers(max_value=-1), min_size=1, max_size=3).map(
                             lambda values: ",".join(map(str, values))))
    if kind == "choice":
        choices = {str(choice) for choice in option.action.choices}
        return st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
            lambda text: text not in choices)
    if kind == "dtype":
        return st.sampled_from(["int8", "float64", "float", "half32", "fp8", "torch.int32"])
    if kind == "device":
        return st.sampled_from(["tpu", "cuda:99", "cpu:x", "gpu", "cuda:-1"])
    if kind == "in_file":
        return st.sampled_from([str(root / "no-such-file.txt"), str(scratch.adir), str(root / "nowhere" / "x.txt")])
    if kind == "in_dir":
        return st.sampled_from([str(root / "no-such-dir"), str(scratch.afile), str(scratch.model_dir("empty-dir"))])
    if kind == "model":
        return st.sampled_from([str(root / "no-such-model"), str(scratch.afile), "no-such-named-model",
                                *(str(scratch.model_dir(name)) for name in
                                  ("empty-dir", "config-not-json", "config-a-list", "config-partial")),
                                str(root / "models" / "garbage.gguf"), str(root / "models" / "truncated.gguf")])
    if kind == "out_file":
        return st.sampled_from([str(scratch.afile / "out.json"), str(scratch.adir)])
    if kind == "out_dir":
        return st.sampled_from([str(scratch.afile / "out"), str(scratch.afile)])
    raise AssertionError(f"no bad values for kind {kind!r}")


# Huge counts that a command accepts and then spends minutes on (or crashes on) before it
# loads weights: open findings of the generator, left out of its draws until fixed.
HUGE_OPEN = {
    ("bench serve", "--num-prompts"): "builds every prompt first (MemoryError at 10**40)",
    ("eval niah", "--depths"): "builds every prompt first",
    ("eval niah", "--samples"): "builds every prompt first",
    ("eval niah", "--key-digits"): "ValueError past Python's 4300-digit int limit",
    ("eval niah", "--multi-turn"): "builds every prompt first",
}


def edge_value(kind: str, option, scratch: Scratch, huge: bool = False) -> st.SearchStrategy[str] | None:
    """Values an option of `kind` may accept or refuse; None where the kind has none. `huge`
    adds huge counts (slow suite: a command may accept one and work long before loading)."""
    if kind == "int":
        if not huge or (option.command, option.flag) in HUGE_OPEN:
            return st.just("0")
        return st.one_of(st.just("0"), st.integers(min_value=10**6, max_value=10**40).map(str))
    if kind == "float":
        return st.one_of(st.sampled_from(["0", "inf", "1e308", "1e-320"]),
                         st.floats(min_value=1e6, max_value=1e300).map(repr))
    if kind == "int_list":
        return st.sampled_from(["0", "0,0", "100000000", ""])
    if kind == "in_file":
        return st.just(str(scratch.root / "empty.txt"))
    if kind == "model":
        return st.just(str(scratch.model_dir("config-no-weights")))
    return None
