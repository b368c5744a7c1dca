"""CPU kernels that give the same numbers on every x86-64 CPU: set before torch loads (standard library only).

A demo pretrains a toy ViT from a random init (300 AdamW steps at lr 1e-2), which amplifies rounding: the same
study on an AVX2 AMD and an AVX-512 Intel CPU ended at other weights (plasticity up to 2x apart), and on one
machine PyTorch's default kernels against its AVX2 ones moved per-layer plasticity by up to 46%. Each library
picks its code path by the CPU it finds; :data:`PINNED_KERNELS` asks each for the one every x86-64 CPU runs
alike:

* ``ATEN_CPU_CAPABILITY=default``: PyTorch's own kernels compiled for the x86-64 baseline (its AVX2 and
  AVX-512 ones vectorise sums in other orders; ATen trusts the variable, and every x86-64 CPU runs ``default``);
* ``MKL_CBWR=COMPATIBLE``: MKL's conditional-numerical-reproducibility branch that gives the same results on
  every CPU (the only one MKL honours on non-Intel CPUs);
* ``DNNL_MAX_CPU_ISA=SSE41``: oneDNN's convolution and GELU kernels held to SSE4.1.

It costs speed on the CPU (vector units left idle); GPUs are unaffected. A value already in the environment
wins, so ``ATEN_CPU_CAPABILITY=avx2 make demo`` (or any other value) runs the CPU's faster kernels. The libraries
read these variables when torch loads them; Ray's local workers inherit them from the driver's environment.
"""

from __future__ import annotations

import os
import platform

#: one code path per library that every x86-64 CPU runs alike (module docstring)
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "DNNL_MAX_CPU_ISA": "SSE41"}


def pin_cpu_kernels() -> dict[str, str]:
    """Put :data:`PINNED_KERNELS` in the environment of an x86-64 machine (a value already there wins);
    returns the values in force (empty on other machines)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    for name, value in PINNED_KERNELS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in PINNED_KERNELS}
