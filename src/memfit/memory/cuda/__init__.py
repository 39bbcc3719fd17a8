"""CUDA kernel model: CUDA's kernel choices and kernel memory, for fake traces of a GPU target.

NOTE [ CUDA kernel model ]
A GPU preset is traced on fake *CPU* tensors (autograd cannot run backward on fake CUDA tensors
without a driver), so left alone the trace makes the CPU's kernel choices: SDPA's math path with
[B, H, T, T] scores when there is dropout, the CPU's autocast op lists, for-loop optimizers,
oneDNN RNNs, float dropout masks. And no storage tracker sees what CUDA kernels allocate inside
(cuBLAS workspaces per thread, attention and reduction buffers, cuDNN workspaces). Measured on an
H100 (tests/data/h100.jsonl), that put GPU predictions off by a median of 35%.

Whenever the target is a GPU (a preset, or the local card with ``--device cuda``, where the trace
runs on fake CUDA tensors), the trace runs inside :func:`cuda_kernel_model`, which applies one
rule per kernel family, each a small module with its source:

- ``sdpa``: attention backend selection (cuDNN / flash / memory-efficient / math) as
  ``select_sdp_backend`` makes it for the card, dtype, head dim, mask and dropout, and the
  fused kernels' internal buffers;
- ``autocast``: CUDA's autocast op lists (fp32 for pow/exp/softmax/layer_norm/...);
- ``composites``: fused dropout (boolean masks), cuDNN RNN routing, SDPA registration;
- ``optim``: the foreach optimizer default of CUDA parameters;
- ``blas``: a cuBLAS workspace (and a cuBLASLt one for fused-bias matmuls) per thread that runs
  matmuls: forward's and autograd's;
- ``reduce``: global staging buffers of split reductions (``setReduceConfig``);
- ``conv``: cuDNN convolution workspaces (calibrated);
- ``rnn``: cuDNN RNN weight buffer, reserve and workspace;
- ``grouped_gemm``: mixture-of-experts grouped GEMMs: transformers' choice of kernel for the card,
  CUTLASS's bf16 kernel (sm90/sm100) and its buffers, else the cuBLAS loop.

Device facts the rules need (compute capability, SM count, CUDA/cuDNN versions, workspace sizes)
come from :class:`memfit.devices.Device`.
"""

from memfit.memory.cuda.model import KernelMode, cuda_kernel_model

__all__ = ["KernelMode", "cuda_kernel_model"]
