"""Compile every kvforge Triton kernel for an H100/H200 (sm_90) without a GPU, and print
what each gave as one JSON object: {kernel: {"error": str | None, "shared": bytes}} under
"kernels", the launchable kernels the modules define under "defined", and other settings of
some kernels under "variants".

Triton's interpreter (how `make test` runs the kernels) accepts code the GPU compiler
refuses and never lowers it; `triton.compile` with a GPU target runs the whole pipeline
(TTIR, TTGIR, LLVM, PTX and the bundled ptxas to a cubin) on the host. The settings are
Llama-3.1-8B's decode in bf16: head_dim 128, four query heads per KV head, ShadowKV chunks
of 8, KIVI 2-bit groups of 32, pages of 16 tokens. As Triton's JIT does at a launch, every
pointer argument is taken as 16-byte aligned (torch's allocations are), and so is every
integer marked `:16` (a stride or address such a launch passes as a multiple of 16). Each
kernel also reports its global loads and stores by width in bytes, read from the PTX
("ld2": 2-byte loads; "cp16": 16-byte asynchronous copies to shared memory, which is how a
pipelined loop loads its next tile). Run in a process of its own: the kernels must be decorated with the
interpreter off (TRITON_INTERPRET unset before triton loads).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvforge.cache.full import triton_decode as full  # noqa: E402
from kvforge.cache.full import triton_store as full_store  # noqa: E402
from kvforge.cache.kivi import triton_decode as kivi  # noqa: E402
from kvforge.cache.shadowkv import triton_decode as shadowkv  # noqa: E402
from kvforge.cache.shadowkv import triton_slots as slots  # noqa: E402
from kvforge.kernels import triton_fused as fused  # noqa: E402

MODULES = (full, full_store, kivi, shadowkv, slots, fused)
TARGET = GPUTarget("cuda", 90, 32)
IDS, I32, I64, BF16, F32, BOOL = "*i64", "i32", "i64", "*bf16", "*fp32", "*i1"
I32_16, I64_16 = "i32:16", "i64:16"  # multiples of 16 at these shapes
SHADOWKV_FIELDS = 13
# Strides a launch passes as multiples of 16 at these shapes (query and own-token rows,
# residual rings, the stores' heads and pages; ShadowKV's landmarks likewise): Triton's JIT hints such integers, as it does
# aligned pointers, so these compile as a real launch does.
FULL_STRIDES = "sq_b sq_h sks_b sks_h svs_b svs_h skp_p skp_t svp_p svp_t"
KIVI_STRIDES = "sq_b sq_h sks_b sks_h svs_b svs_h skc_h skc_p sks_hh sks_p svc_h svc_p svp_h svp_p " \
               "skr_s skr_h skr_r svr_s svr_h svr_r"

# kernel -> (argument types, constexpr values); an argument named in neither is an error
KERNELS = {
    full._paged_decode_kernel: (
        dict(q_ptr=BF16, k_self_ptr=BF16, v_self_ptr=BF16, k_pages_ptr=BF16, v_pages_ptr=BF16, table_ptr=IDS,
             first_ptr=IDS, from_ptr=IDS, to_ptr=IDS, out_ptr=F32, part_max_ptr=F32, part_sum_ptr=F32, skp_h=I64_16,
             svp_h=I64_16,
             stab_b=I32, table_width=I32, scale="fp32", split_tokens=I32, **dict.fromkeys(FULL_STRIDES.split(), I32_16)),
        dict(QUERY_GROUP=4, BLOCK_Q=16, HEAD_DIM=128, BLOCK_D=128, PAGE_BLOCK=16, BLOCK_T=32, SPLIT=True)),
    # the step's keys and values as slices of a packed q/k/v row (48 x 128 elements at 8B's shapes)
    full_store._rope_store_kernel: (
        dict(k_ptr=BF16, k_row_stride=I32_16, v_ptr=BF16, v_row_stride=I32_16, cos_ptr=BF16, sin_ptr=BF16,
             k_out_ptr=BF16, k_pages_ptr=BF16, v_pages_ptr=BF16, slots_ptr=IDS, heads=I32, dim=I32_16,
             half=I32_16, page_head_stride=I64_16),
        dict(BLOCK_H=8, BLOCK_HALF=64, BLOCK_D=128)),
    full._reduce_kernel: (
        dict(part_acc_ptr=F32, part_max_ptr=F32, part_sum_ptr=F32, out_ptr=BF16, splits=I32),
        dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32)),
    kivi._kivi_decode_kernel: (
        dict(q_ptr=BF16, k_self_ptr=BF16, v_self_ptr=BF16, k_codes_ptr="*u8", v_codes_ptr="*u8",
             k_scale_ptr="*fp16", k_zero_ptr="*fp16", v_scale_ptr="*fp16", v_zero_ptr="*fp16", k_res_ptr=BF16,
             v_res_ptr=BF16, out_ptr=F32, part_max_ptr=F32, part_sum_ptr=F32, scale="fp32",
             **dict.fromkeys(KIVI_STRIDES.split(), I32_16)),
        dict(QUERY_GROUP=4, BLOCK_Q=16, HEAD_DIM=128, BLOCK_D=128, BITS=2, VALUE_BITS=2, GROUP=32, BLOCK_T=32, SUB=32, PARTS=1,
             GROUPS_BLOCK=4, SPLIT=True)),
    kivi._combine_kernel: (
        dict(part_acc_ptr=F32, part_max_ptr=F32, part_sum_ptr=F32, out_ptr=BF16, splits=I32),
        dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=32)),
    shadowkv._scores_kernel: (
        dict(q_ptr=BF16, landmarks_ptr=BF16, table_ptr=IDS, info_ptr=IDS, scores_ptr=F32, sq_b=I32_16, sq_h=I32_16,
             sl_h=I32_16, sl_p=I32_16, stab_b=I32, width=I32, scale="fp32"),
        dict(QUERY_GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK=32, NFIELDS=SHADOWKV_FIELDS)),
    shadowkv._rebuild_kernel: (
        dict(info_ptr=IDS, keys_like=BF16, basis_like=BF16, coef_like=BF16, new_ids_ptr=IDS, filled_ptr=BOOL,
             cos_ptr=BF16, sin_ptr=BF16, basis_width=I32_16),
        dict(CHUNK=8, BLOCK_T=16, HEAD_DIM=128, HALF=64, BLOCK_HALF=64, BLOCK_R=16, NFIELDS=SHADOWKV_FIELDS)),
    shadowkv._values_kernel: (
        dict(info_ptr=IDS, values_like=BF16, fetched_ptr=BF16, order_ptr=IDS, kv_heads=I32, slots=I32),
        dict(CHUNK=8, BLOCK_T=8, HEAD_DIM=128, BLOCK_D=128, NFIELDS=SHADOWKV_FIELDS)),
    shadowkv._attention_kernel: (
        dict(q_ptr=BF16, own_k_ptr=BF16, own_v_ptr=BF16, info_ptr=IDS, keys_like=BF16, slot_ids_ptr=IDS,
             out_ptr=BF16, sq_b=I32_16, sq_h=I32_16, so_b=I32_16, so_h=I32_16, sv_b=I32_16, sv_h=I32_16, slots=I32,
             scale="fp32"),
        dict(QUERY_GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, CHUNK=8, BLOCK=32, MASK_SLOTS=True,
             NFIELDS=SHADOWKV_FIELDS)),
    slots._values_in_place_kernel: (
        dict(info_ptr=IDS, values_like=BF16, slow_address=I64_16, new_ids_ptr=IDS, filled_ptr=BOOL, table_ptr=IDS,
             stab_b=I32, slow_head_stride=I64_16),
        dict(CHUNK=8, BLOCK_T=8, HEAD_DIM=128, BLOCK_D=128, NFIELDS=SHADOWKV_FIELDS)),
    slots._held_kernel: (dict(info_ptr=IDS, held_ptr=IDS, slots=I32), dict(BLOCK_S=256, NFIELDS=SHADOWKV_FIELDS)),
    slots._keep_kernel: (dict(info_ptr=IDS, new_ids_ptr=IDS, slots=I32), dict(BLOCK_S=256, NFIELDS=SHADOWKV_FIELDS)),
    slots._match_kernel: (
        dict(info_ptr=IDS, top_scores_ptr=F32, top_ids_ptr=IDS, k_ptr=IDS, new_ids_ptr=IDS, filled_ptr=BOOL,
             counts_ptr=IDS, picks=I32, slots=I32),
        dict(REUSE=True, BLOCK_K=16, BLOCK_S=256, NFIELDS=SHADOWKV_FIELDS)),
    # with the residual add (a layer's add after attention, and the norm before the MLP)
    fused._rms_norm_kernel: (dict(x_ptr=BF16, delta_ptr=BF16, delta_w_ptr=BF16, sum_ptr=BF16, w_ptr=BF16,
                                  out_ptr=BF16, dim=I32_16, eps="fp32", delta_eps="fp32"),
                             dict(GEMMA=False, ADD=True, NORM_DELTA=False, NORM_OUT=True, BLOCK_D=4096)),
    # rows apart (a packed q/k/v output: (32 + 2 x 8) x 128 elements a row at 8B's shapes)
    fused._rope_kernel: (dict(x_ptr=BF16, x_row_stride=I32_16, cos_ptr=BF16, sin_ptr=BF16, out_ptr=BF16, heads=I32,
                              dim=I32_16, half=I32_16),
                         dict(BLOCK_H=32, BLOCK_HALF=64)),
    fused._gate_mul_kernel: (dict(gate_ptr=BF16, gate_row_stride=I32_16, up_ptr=BF16, up_row_stride=I32_16,
                                  out_ptr=BF16, cols=I32_16), dict(GELU_TANH=False, BLOCK=1024)),
}

# Other settings of kernels whose code paths depend on their constants, compiled beside the
# ones above: KIVI with parts of 4 tokens over several pages, each channel gathering its value
# scale, head_dim 96 padded to 128, and the output written unsplit in bf16; 4-bit codes in
# pages of 128 tokens (four tiles per page); and 4-bit keys beside 2-bit values. Gemma's
# RMSNorm alone, in its sandwich around the residual add, and added after its norm; its
# GELU-tanh gate.
_KIVI_TYPES, _KIVI_CONSTANTS = KERNELS[kivi._kivi_decode_kernel]
VARIANTS = {
    "kivi group 12, head_dim 96, unsplit": (kivi._kivi_decode_kernel, {**_KIVI_TYPES, "out_ptr": BF16}, {
        **_KIVI_CONSTANTS, "HEAD_DIM": 96, "GROUP": 12, "SUB": 4, "PARTS": 8, "GROUPS_BLOCK": 0, "SPLIT": False}),
    "kivi 4-bit, group 128": (kivi._kivi_decode_kernel, _KIVI_TYPES, {
        **_KIVI_CONSTANTS, "BITS": 4, "VALUE_BITS": 4, "GROUP": 128, "SUB": 32, "PARTS": 1, "GROUPS_BLOCK": 1}),
    "kivi 4-bit keys, 2-bit values": (kivi._kivi_decode_kernel, _KIVI_TYPES, {**_KIVI_CONSTANTS, "BITS": 4}),
    "rms_norm alone, gemma": (fused._rms_norm_kernel, KERNELS[fused._rms_norm_kernel][0],
                              dict(GEMMA=True, ADD=False, NORM_DELTA=False, NORM_OUT=True, BLOCK_D=4096)),
    "gemma sandwich norms": (fused._rms_norm_kernel, KERNELS[fused._rms_norm_kernel][0],
                             dict(GEMMA=True, ADD=True, NORM_DELTA=True, NORM_OUT=True, BLOCK_D=4096)),
    "gemma add of a norm": (fused._rms_norm_kernel, KERNELS[fused._rms_norm_kernel][0],
                            dict(GEMMA=True, ADD=True, NORM_DELTA=True, NORM_OUT=False, BLOCK_D=4096)),
    "gemma gelu-tanh gate": (fused._gate_mul_kernel, KERNELS[fused._gate_mul_kernel][0],
                             dict(GELU_TANH=True, BLOCK=1024)),
}


def _signature(kernel: triton.JITFunction, types: dict[str, str], constants: dict[str, object]) -> dict[str, str]:
    """Each argument's type; of the kernel's other arguments, `*_ptr` ones point at int64
    (tables, ids, lengths) and the rest (strides, sizes) are i32."""
    named = {**types, **dict.fromkeys(constants, "constexpr")}
    return {arg: named.get(arg, IDS if arg.endswith("_ptr") else I32) for arg in kernel.arg_names}


def _aligned(kernel: triton.JITFunction, signature: dict[str, str]) -> dict[tuple[int], list[list[object]]]:
    """Triton's divisibility hints: pointers, and the integers marked `:16`."""
    return {(index,): [["tt.divisibility", 16]] for index, arg in enumerate(kernel.arg_names)
            if signature[arg].startswith("*") or signature[arg].endswith(":16")}


def access_widths(ptx: str) -> dict[str, int]:
    """Global loads and stores by bytes moved per instruction ("ld16": 16-byte loads), and
    asynchronous copies from global to shared memory ("cp16"), which is how the compiler
    loads a pipelined loop's next tile."""
    found: Counter[str] = Counter()
    for size in re.findall(r"\bcp\.async\.c[ag]\.shared\.global\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-f]+|\d+)", ptx):
        found[f"cp{int(size, 0)}"] += 1
    for op, qualifiers in re.findall(r"\b(ld|st)\.global(\S*)", ptx):  # e.g. ld.global.v4.b32
        vector = re.search(r"\.v(\d)\b", qualifiers)
        bits = re.search(r"\.[bfsu](\d+)\b", qualifiers)
        assert bits, f"no element type in {op}.global{qualifiers}"
        found[f"{op}{int(vector.group(1) if vector else 1) * int(bits.group(1)) // 8}"] += 1
    return dict(found)


def compile_one(kernel: triton.JITFunction, types: dict[str, str], constants: dict[str, object]) -> dict:
    signature = _signature(kernel, types, constants)
    try:
        source = ASTSource(kernel, {arg: kind.removesuffix(":16") for arg, kind in signature.items()},
                           constexprs=constants, attrs=_aligned(kernel, signature))
        compiled = triton.compile(source, target=TARGET)
    except Exception as error:  # what the compiler says is the finding
        return {"error": f"{type(error).__name__}: {str(error)[:2000]}", "shared": 0, "widths": {}}
    return {"error": None, "shared": int(compiled.metadata.shared), "widths": access_widths(compiled.asm["ptx"])}


def main() -> None:
    defined = sorted(f"{module.__name__}.{name}" for module in MODULES for name, value in vars(module).items()
                     if isinstance(value, triton.JITFunction) and name.endswith("_kernel"))
    results = {f"{kernel.fn.__module__}.{kernel.fn.__name__}": compile_one(kernel, *settings)
               for kernel, settings in KERNELS.items()}
    variants = {label: compile_one(kernel, *settings) for label, (kernel, *settings) in VARIANTS.items()}
    json.dump({"defined": defined, "kernels": results, "variants": variants}, sys.stdout)


if __name__ == "__main__":
    main()
