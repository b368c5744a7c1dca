"""PyTorch's defaults as a fresh process has them: fp32 sets the default TF32 flags as the paper's authors ran."""

from __future__ import annotations


def test_fp32_sets_pytorchs_default_tf32_flags_as_the_authors():
    """The authors' code sets no TF32 flag, so their runs have PyTorch's defaults: read in a fresh process."""
    import json
    import subprocess
    import sys

    from raystudy.core.finetune.step import tf32_flags

    code = ("import json, torch; print(json.dumps({'matmul': torch.backends.cuda.matmul.allow_tf32, "
            "'cudnn': torch.backends.cudnn.allow_tf32, 'precision': torch.get_float32_matmul_precision()}))")
    defaults = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                         check=True).stdout)
    assert defaults["precision"] == "highest"
    assert tf32_flags("fp32") == {"matmul": defaults["matmul"], "cudnn": defaults["cudnn"]} == {"matmul": False,
                                                                                                 "cudnn": True}
    assert tf32_flags("bf16") == {"matmul": True, "cudnn": True}

