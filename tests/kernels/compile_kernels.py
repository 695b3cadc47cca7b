"""Compile every Triton kernel ahead of time for an NVIDIA target, on a machine without a GPU.

    python -m tests.kernels.compile_kernels [sm] [dtypes]   # from the repo root;   # default: 90 bf16,fp16,fp32

The interpreter runs kernels as Python and so cannot catch what only the compiler rejects
(type unification across runtime branches, `tl.dot` shape/dtype rules, the specialisation of
integer arguments equal to 1 into constants). This builds TTIR → PTX → cubin with triton's
bundled ptxas for representative argument types. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton_bgmv import _bgmv_expand_kernel, _bgmv_shrink_kernel
from kernels.triton_paged_attention import _paged_decode_kernel, _paged_merge_kernel
from kernels.triton_sgmv import _sgmv_expand_kernel, _sgmv_shrink_kernel


def signature(fn, pointers: dict, constants: dict, ones: tuple[str, ...]) -> tuple[dict, dict]:
    """Types for every argument: pointers as given, the rest i32; `ones` specialised to 1."""
    ones = tuple(n for n in ones if n in fn.arg_names)
    sig, consts = {}, {**constants, **dict.fromkeys(ones, 1)}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in consts else pointers.get(name, "i32")
    return sig, consts


def configs(dt: str) -> list[tuple]:
    io = {n: f"*{dt}" for n in ("x_ptr", "a0", "a1", "a2", "b0", "b1", "b2", "y0", "y1", "y2")}
    idx = {n: "*i32" for n in ("slot_ptr", "tok_ptr", "start_ptr", "count_ptr")}
    ptrs = {**io, **idx, "h_ptr": "*fp32", "w_ptr": "*fp32"}
    acc = {**ptrs, "y0": "*fp32", "y1": "*fp32", "y2": "*fp32"}
    # strides of 1 on some outputs only: the mixed case a runtime branch cannot unify
    ones = ("sx_d", "sa0_d", "sa1_d", "sb0_r", "sb1_r", "sy0_n", "sy1_n")
    ieee = dt == "fp32"
    out = []
    for n in (1, 2, 3):
        out += [
            (_bgmv_shrink_kernel, ptrs, dict(NUM_OUT=n, SPLIT=4, BLOCK_R=16, BLOCK_K=512), ones),
            (_bgmv_expand_kernel, ptrs, dict(NUM_OUT=n, SPLIT=4, BLOCK_R=16, BLOCK_N=512), ones),
        ]
    blocks = dict(BLOCK_M=64, BLOCK_R=16)
    out += [
        (_bgmv_shrink_kernel, ptrs, dict(NUM_OUT=1, SPLIT=1, BLOCK_R=128, BLOCK_K=64), ("K",)),
        (_sgmv_shrink_kernel, ptrs, dict(NUM_OUT=3, DOT_IEEE=ieee, BLOCK_K=64, **blocks), ones),
        (_sgmv_shrink_kernel, ptrs, dict(NUM_OUT=1, DOT_IEEE=ieee, BLOCK_K=32, BLOCK_M=16,
                                         BLOCK_R=128), ()),
        (_sgmv_expand_kernel, ptrs, dict(NUM_OUT=1, ACCUM=False, DOT_IEEE=ieee, BLOCK_N=128,
                                         **blocks), ones),
        (_sgmv_expand_kernel, acc, dict(NUM_OUT=3, ACCUM=True, DOT_IEEE=ieee, BLOCK_N=128,
                                        **blocks), ones),
    ]  # fmt: skip
    # paged decode attention: SmolLM2's G=3 (padded to 4), D=64, split-K; a direct launch with a
    # bf16 cache under another q dtype, G=1 and unit strides specialised; the split merge.
    paged = {
        "q_ptr": f"*{dt}",
        "k_ptr": f"*{dt}",
        "v_ptr": f"*{dt}",
        "o_ptr": f"*{dt}",
        "bt_ptr": "*i32",
        "len_ptr": "*i32",
        "m_ptr": "*fp32",
        "l_ptr": "*fp32",
        "acc_ptr": "*fp32",
        "scale": "fp32",
    }
    mixed = {**paged, "k_ptr": "*bf16", "v_ptr": "*bf16"}
    unit = ("sq_d", "sk_d", "sv_d", "so_d", "sbt_n")
    out += [
        (_paged_decode_kernel, paged, dict(BLOCK_G=4, TILE=32, BLOCK_D=64, DIRECT=False), ()),
        (_paged_decode_kernel, mixed, dict(BLOCK_G=1, TILE=64, BLOCK_D=128, DIRECT=True),
         (*unit, "G", "SPLITS")),
        (_paged_merge_kernel, paged, dict(BLOCK_S=8, BLOCK_D=64), ("so_d",)),
    ]  # fmt: skip
    return out


def main(sm: int = 90, dtypes: str = "bf16,fp16,fp32") -> int:
    target = GPUTarget("cuda", sm, 32)
    start = time.perf_counter()
    count = 0
    for dt in dtypes.split(","):
        for fn, ptrs, constants, ones in configs(dt):
            sig, consts = signature(fn, ptrs, constants, ones)
            kernel = triton.compile(ASTSource(fn, sig, consts), target=target)
            assert kernel.asm["cubin"], fn.__name__
            count += 1
    print(f"compiled {count} kernel variants for sm_{sm} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*(int(a) if a.isdigit() else a for a in sys.argv[1:3])))
