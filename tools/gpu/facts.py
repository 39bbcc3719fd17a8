"""Facts about the local CUDA GPU that a memory model needs and a CPU cannot tell.

Prints one JSON object (and writes it with ``--out``):

- versions (torch, CUDA, cuDNN, driver), the card, the CUDA context size (``total - free`` after
  initialisation, before any tensor), allocator and TF32 settings;
- scaled-dot-product attention: the enabled flags, the backend priority order, and for each
  (dtype, head_dim 64, dropout, causal / additive mask) whether flash, memory-efficient and cuDNN
  attention can run (``can_use_*`` with ``SDPAParams``) and which ATen kernel
  ``F.scaled_dot_product_attention`` really dispatched to, forward and backward;
- cuBLAS workspaces: ``CUBLAS_WORKSPACE_CONFIG`` and the ``memory_allocated`` left behind by the first
  matmul of each dtype on the main thread, on a new thread, and in autograd's backward thread;
- whether ``torch.optim.AdamW`` picks foreach (or fused) for CUDA parameters, and for fake ones.

    python -m tools.gpu.facts --out facts.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """Records the ATen ops that run (attention kernels only)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "attention" in name or "scaled_dot_product" in name or name.startswith("aten.bmm") or "softmax" in name:
            if name not in self.ops:
                self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _sdpa_params(q, k, v, mask, dropout, causal):
    P = torch.backends.cuda.SDPAParams
    try:
        return P(q, k, v, mask, dropout, causal, False)
    except TypeError:
        return P(q, k, v, mask, dropout, causal)


def sdpa_facts() -> dict:
    cb = torch.backends.cuda
    out: dict = {"enabled": {name: getattr(cb, f"{name}_sdp_enabled")() for name in
                             ("flash", "mem_efficient", "math", "cudnn") if hasattr(cb, f"{name}_sdp_enabled")}}
    try:
        from torch.nn.attention import SDPBackend
        out["priority_order"] = [SDPBackend(i).name for i in torch._C._get_sdp_priority_order()]
    except Exception as e:  # noqa: BLE001
        out["priority_order"] = f"unavailable: {type(e).__name__}"
    cases = []
    B, H, T, D = 2, 12, 1024, 64
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for dropout in (0.0, 0.1):
            for masking in ("causal", "attn_mask", "none"):
                q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
                mask = None
                if masking == "attn_mask":
                    mask = torch.zeros(B, 1, T, T, device="cuda", dtype=dtype)
                    mask.masked_fill_(torch.ones(T, T, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
                causal = masking == "causal"
                row = {"dtype": str(dtype).replace("torch.", ""), "B": B, "H": H, "T": T, "head_dim": D,
                       "dropout": dropout, "mask": masking}
                params = _sdpa_params(q, k, v, mask, dropout, causal)
                for name in ("flash", "efficient", "cudnn"):
                    fn = getattr(cb, f"can_use_{name}_attention", None)
                    if fn is not None:
                        try:
                            row[f"can_use_{name}"] = bool(fn(params, False))
                        except Exception as e:  # noqa: BLE001
                            row[f"can_use_{name}"] = f"{type(e).__name__}: {e}"[:200]
                log = OpLog()
                try:
                    torch.cuda.synchronize()
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    with log:
                        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
                        fwd_ops = list(log.ops)
                        o.sum().backward()
                    torch.cuda.synchronize()
                    row["forward_ops"] = fwd_ops
                    row["backward_ops"] = log.ops[len(fwd_ops):]
                    row["peak_over_inputs_bytes"] = torch.cuda.max_memory_allocated() - before
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                cases.append(row)
                del q, k, v, mask
    out["cases"] = cases
    return out


def _alloc_delta(fn) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def cublas_facts() -> dict:
    out: dict = {"env": {k: v for k, v in os.environ.items() if "CUBLAS" in k or "CUDA_ALLOC" in k or "CUDNN" in k}}
    a16 = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    a32 = torch.randn(1024, 1024, device="cuda")
    out["first_bf16_matmul_main_thread"] = _alloc_delta(lambda: (a16 @ a16).sum().item())
    out["second_bf16_matmul_main_thread"] = _alloc_delta(lambda: (a16 @ a16).sum().item())
    out["first_fp32_matmul_main_thread"] = _alloc_delta(lambda: (a32 @ a32).sum().item())
    out["first_addmm_main_thread"] = _alloc_delta(lambda: torch.addmm(a16[0], a16, a16).sum().item())

    def in_thread():
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("d", _alloc_delta(lambda: (a16 @ a16).sum().item())))
        t.start()
        t.join()
        return box["d"]
    out["first_bf16_matmul_new_thread"] = in_thread()
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)

    def backward():
        (x @ w).sum().backward()
        grads = w.grad.numel() * 4 + x.grad.numel() * 4
        w.grad = x.grad = None
        return grads
    out["first_backward_matmul_autograd_thread"] = _alloc_delta(backward)
    out["second_backward_matmul_autograd_thread"] = _alloc_delta(backward)
    out["note"] = ("bytes still allocated after the op and its outputs are freed: the workspace the handle of that "
                   "thread/stream keeps in the caching allocator (cuBLAS, and cuBLASLt where separate)")
    return out


def adamw_facts() -> dict:
    from torch.optim.optimizer import _default_to_fused_or_foreach
    p = torch.zeros(16, device="cuda", requires_grad=True)
    opt = torch.optim.AdamW([p])
    fused, foreach = _default_to_fused_or_foreach([p], False, False)
    out = {"defaults": {"foreach": opt.defaults.get("foreach"), "fused": opt.defaults.get("fused")},
           "cuda_params": {"fused": fused, "foreach": foreach}}
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fp = torch.nn.Parameter(torch.zeros(16, device="cuda"))
        ffused, fforeach = _default_to_fused_or_foreach([fp], False, False)
    out["fake_cuda_params"] = {"fused": ffused, "foreach": fforeach}
    return out


def machine_facts() -> dict:
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = None
    try:
        settings = torch.cuda.memory._snapshot().get("allocator_settings")
    except Exception:  # noqa: BLE001
        settings = None
    return {"gpu": props.name, "total_memory": props.total_memory, "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}", "nvidia_smi": smi, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
            "context_bytes_after_init": total - free,
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "allocator_settings": settings}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)
    facts: dict = {}
    for key, fn in (("machine", machine_facts), ("cublas", cublas_facts), ("sdpa", sdpa_facts),
                    ("adamw", adamw_facts)):
        try:
            facts[key] = fn()
        except Exception as e:  # noqa: BLE001 - one failing probe must not hide the others
            facts[key] = {"error": f"{type(e).__name__}: {e}"[:400]}
    text = json.dumps(facts, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
