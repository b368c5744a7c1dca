"""The compiled trial step (torch.compile: inductor builds C++ kernels with the system compiler) against the eager
step."""

from __future__ import annotations

from tests.unit.core import test_fast_step
from tests.unit.core.test_fast_step import TINY, assert_step_close, one_step

#: the fixture of test_fast_step.py, a fixture of this file too (the same files, built again here)
store = test_fast_step.store

#: the compiled test's ViT: one block (inductor's compile time grows with the graph; one block has every
#: kind of kernel three have)
ONE_BLOCK = {**TINY, "depth": 1}


# inductor compiles C++ kernels: ~40 s on a free core, a few minutes on the busy 2-core machine
def test_compiled_step_agrees_with_eager(store, tmp_path, monkeypatch):
    """torch.compile (inductor on the CPU): loss and gradient norms within 1e-4, every update within 1e-4
    relative L2 (measured: ~1e-6, float reassociation in the fused kernels)."""
    import torch._inductor.config

    # kernels compiled in this process: a pool of compile workers (one per core) costs more to start than it
    # saves on two shared cores (58 s -> 42 s measured)
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    eager = one_step(store, tmp_path / "a", precision="fp32", model_kwargs=ONE_BLOCK)
    compiled = one_step(store, tmp_path / "b", precision="fp32", compile=True, model_kwargs=ONE_BLOCK)
    assert compiled[0].net is not compiled[0].model and hasattr(compiled[0].net, "_orig_mod")
    assert_step_close(compiled, eager, loss_rtol=1e-4, norm_rtol=1e-4, update_rtol=1e-4)
    summary = compiled[0].summary()
    assert summary["compile"] is True and summary["precision"] == "fp32"

