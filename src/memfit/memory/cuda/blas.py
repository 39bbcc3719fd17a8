"""Rule: each thread that runs matmuls holds its own cuBLAS (and cuBLASLt) workspace.

PyTorch gives every thread its own cuBLAS handle (a per-thread pool window) and attaches a
workspace to each (handle, stream) pair the first time that thread calls cuBLAS
(aten/src/ATen/cuda/CublasHandlePool.cpp, ``getCurrentCUDABlasHandle`` ->
``setWorkspaceForHandle``). The workspace comes from the caching allocator, is never freed, and
its size is ``CUBLAS_WORKSPACE_CONFIG`` or the default: 32 MiB on Hopper and newer, 8.125 MiB
before (``memfit.devices.cublas_workspace_bytes``).

A training step runs matmuls on two threads: the forward on the caller's thread and the backward
on autograd's device thread (one per GPU; checkpoint recomputation and optimizer-in-backward
hooks also run there). So a step holds two workspaces, each allocated right after the output of
the first matmul its thread runs (snap-mha-bf16: two live 32 MiB blocks, one per thread).

``addmm`` with a 1-D bias (``nn.Linear``'s fused bias epilogue, ``gemm_and_bias``) and
``_addmm_activation`` go through cuBLASLt, whose workspace (``CUBLASLT_WORKSPACE_SIZE``,
default 1 MiB) is also per thread and stream and allocated on first use, after the cuBLAS one
(``getCUDABlasLtWorkspace``; snap-gpt2-bf16-small, snap-cnn-fp32).

In a fake trace the thread is known from autograd: an op runs on the device thread while a
graph task is executing (``torch._C._current_graph_task_id() != -1``).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

CUBLAS_OPS = {
    aten.mm.default, aten.addmm.default, aten._addmm_activation.default, aten.bmm.default, aten.baddbmm.default,
    aten.addbmm.default, aten.addmv.default, aten.mv.default, aten.dot.default, aten.vdot.default,
}
LT_OPS = {aten._addmm_activation.default}


def thread() -> str:
    """'autograd' inside a backward pass (autograd's device thread on CUDA), else 'main'."""
    return "autograd" if torch._C._current_graph_task_id() != -1 else "main"


def uses_cublas(func, args, out) -> bool:
    if func not in CUBLAS_OPS:
        return False
    if isinstance(out, torch.Tensor) and out.numel() == 0:
        return False
    mats = [a for a in args if isinstance(a, torch.Tensor)]
    if func in (aten.addmm.default, aten.baddbmm.default, aten.addbmm.default, aten.addmv.default,
                aten._addmm_activation.default):
        mats = mats[1:]
    if any(m.numel() == 0 for m in mats):  # a zero inner dimension is handled without cuBLAS
        return False
    return all(m.is_floating_point() or m.is_complex() for m in mats)


def uses_cublaslt(func, args, kwargs) -> bool:
    """addmm with a bias that cuBLASLt fuses (Blas.cpp ``isInputCompliesAddmmCudaLt``)."""
    if func in LT_OPS:
        return True
    if func is not aten.addmm.default:
        return False
    bias, mat1, mat2 = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    return (beta == 1 and bias.dim() in (1, 2) and (bias.dim() == 1 or bias.shape[0] == 1)
            and bias.shape[-1] == mat2.shape[1] and bias.is_contiguous()
            and bias.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            and mat1.shape[0] > 1 and mat1.shape[1] > 1 and mat2.shape[0] > 1 and mat2.shape[1] > 1)
