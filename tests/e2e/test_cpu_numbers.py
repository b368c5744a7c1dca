"""The pinned CPU kernels (raystudy/cpu_kernels.py) make a toy ViT's training end at the same weights whatever
code path the CPU would offer, on one machine: 30 AdamW steps at lr 1e-2 (the demo's recipe amplifies rounding)
run in fresh processes. PyTorch's AVX2 kernels against its baseline ones end elsewhere (so the check can see a
kernel's difference); with the pins, MKL told of an older or a newer instruction set ends at the same bits."""

from __future__ import annotations

import os
import subprocess
import sys

from raystudy.cpu_kernels import PINNED_KERNELS
from tests.support.processes import user_env

TRAIN = """
import hashlib, torch, timm
torch.set_num_threads(1)
torch.manual_seed(0)
m = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, depth=4, num_heads=4,
                      num_classes=10)
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
for _ in range(30):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest())
"""


def _weights_hash(**env: str) -> str:
    base = {k: v for k, v in user_env().items() if k not in (*PINNED_KERNELS, "MKL_ENABLE_INSTRUCTIONS")}
    run = subprocess.run([sys.executable, "-c", TRAIN], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_pinned_kernels_end_at_the_same_weights_whatever_the_cpu_offers():
    if os.uname().machine not in ("x86_64", "AMD64"):
        raise AssertionError("the pins are defined for x86-64; this check needs one")
    with open("/proc/cpuinfo") as f:
        has_avx2 = "avx2" in f.read()
    pinned = _weights_hash(**PINNED_KERNELS)
    assert _weights_hash(**PINNED_KERNELS, MKL_ENABLE_INSTRUCTIONS="SSE4_2") == pinned
    if has_avx2:
        assert _weights_hash(**PINNED_KERNELS, MKL_ENABLE_INSTRUCTIONS="AVX2") == pinned
        assert _weights_hash(ATEN_CPU_CAPABILITY="avx2") != pinned  # the kernels this machine would pick
