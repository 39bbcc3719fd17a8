"""Rule: LSTM/GRU/RNN layers run cuDNN's ``_cudnn_rnn`` on CUDA, with its reserve and workspace.

``torch.lstm`` (and gru, rnn_tanh, rnn_relu) is a composite that asks ``cudnn_is_acceptable``
(fp32/fp16/fp64 input, cuDNN enabled) and then calls ``_cudnn_rnn`` once for all layers and time
steps (aten/src/ATen/native/cudnn/RNN.cpp). On the CPU the same call runs oneDNN's per-layer
kernel instead, whose scratch memfit probes on the machine at hand; neither says anything about
cuDNN's memory. What ``_cudnn_rnn`` holds on the GPU:

- ``weight_buf``: the weights as one flat buffer. ``nn.LSTM`` on CUDA flattens its parameters
  into one buffer (``flatten_parameters``) and the kernel uses it in place (an H200 snapshot of
  an LSTM LM shows no copy); under autocast, ``_cudnn_rnn_cast_reflatten`` casts the weights into
  one fresh buffer, which the trace's weight casts stand for. The meta kernel returns the
  ``weight_buf`` it was given, i.e. None, which made backward fail on fake CUDA tensors ("Expected
  a proper Tensor but got None ... 'weight_buf'"); this rule returns a view of the weights with
  the flat size (no new memory).
- ``reserve``: what cuDNN keeps from forward for backward (``cudnnGetRNNTempSpaceSizes``). The
  meta kernel says 0 bytes. Measured on an H100 and an H200 (cuDNN 9.19, tools/gpu/rnn_facts.py,
  120 shapes, exact in every one): ``(6 * layers - 1)`` (LSTM) or ``(7 * layers - 1)`` (GRU)
  values of the input dtype per (direction, step, sample, hidden unit), plus 256 bytes, plus one
  bit per value of each inner layer's output when dropout is on (its mask).
- cuDNN's dropout state: the first training call with dropout allocates it (``sm_count * 48 KiB``,
  6,488,064 bytes on a 132-SM card) and PyTorch keeps it for the process.
- a workspace during forward and each backward call: the input projections of all time steps
  for one layer (``gates * hidden`` values per step and sample) plus the recurrent state of one
  step; and contiguous ``[T, B, *]`` copies of a batch-first input and gradient.
- a batch-first output is a transposed view of the ``[T, B, D]`` result (not contiguous), as the
  kernel returns it; what follows (a Linear's mm + add rather than addmm) depends on it.
- backward returns the weight gradient as one flat buffer (views of ``dw = zeros_like
  (weight_buf)``) after ``_cudnn_rnn_backward_input`` and ``_cudnn_rnn_backward_weight``.

The reserve follows the measured law above. The workspace depends on the algorithm cuDNN picks for
the shape (measured: 5 to 1000 times one layer's output, largest for small shapes), so its model
(``workspace_bytes``) is a fit, listed as an approximation in the report.

Inputs cuDNN refuses (bf16 without autocast) take PyTorch's generic layer-by-layer path, which
this rule runs with the per-step cell ops (``lstm_cell`` ...). Packed sequences keep the CPU path.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
GATES = {0: 1, 1: 1, 2: 4, 3: 3}
RESERVE_PER_LAYER = {0: 2, 1: 2, 2: 6, 3: 7}
"""Reserve values per layer and (direction, step, sample, hidden unit); one fewer overall.
Measured for LSTM (mode 2) and GRU (3); plain RNNs (0, 1) scaled from them (an estimate)."""
DROPOUT_STATE_PER_SM = 48 * 1024
WORKSPACE_PER_LAYER = 9 * 1024 * 1024
"""The shape-independent part of cuDNN's RNN workspace per layer and direction (fitted)."""


def cudnn_acceptable(input: torch.Tensor) -> bool:
    return torch.backends.cudnn.enabled and input.dtype in (torch.float32, torch.float16, torch.float64)


def composites(device) -> dict:
    """Python kernels for ``lstm.input``, ``gru.input``, ``rnn_tanh.input``, ``rnn_relu.input``."""
    return {f"{name}.input": _make(name) for name in MODES}


def _make(name: str):
    mode = MODES[name]

    def impl(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        hx = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        if not cudnn_acceptable(input) or any(p.dtype != input.dtype for p in params):
            out, hy, cy = _generic(name, input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                   batch_first)
        else:
            h0 = hx[0]
            c0 = hx[1] if mode == 2 else None
            hidden = c0.shape[2] if c0 is not None else h0.shape[2]
            proj = h0.shape[2] if (c0 is not None and h0.shape[2] != c0.shape[2]) else 0
            stride0 = (4 if has_biases else 2) + (1 if proj else 0)
            out, hy, cy, _reserve, _wbuf = aten._cudnn_rnn(input, list(params), stride0, None, h0, c0, mode, hidden,
                                                            proj, num_layers, batch_first, dropout, train,
                                                            bidirectional, [], None)
        return (out, hy, cy) if mode == 2 else (out, hy)
    return impl


def _generic(name, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """PyTorch's non-cuDNN RNN (RNN.cpp ``_rnn_impl``): layer by layer, step by step."""
    cell = {"lstm": torch.lstm_cell, "gru": torch.gru_cell, "rnn_tanh": torch.rnn_tanh_cell,
            "rnn_relu": torch.rnn_relu_cell}[name]
    x = input.transpose(0, 1) if batch_first else input
    dirs = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    h_n, c_n = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            idx = layer * dirs + d
            w = params[idx * per:(idx + 1) * per]
            w_ih, w_hh = w[0], w[1]
            b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
            h = hx[0][idx]
            c = hx[1][idx] if name == "lstm" else None
            steps = range(x.shape[0] - 1, -1, -1) if d else range(x.shape[0])
            ys = [None] * x.shape[0]
            for t in steps:
                if name == "lstm":
                    h, c = cell(x[t], (h, c), w_ih, w_hh, b_ih, b_hh)
                else:
                    h = cell(x[t], h, w_ih, w_hh, b_ih, b_hh)
                ys[t] = h
            outs.append(torch.stack(ys))
            h_n.append(h)
            if c is not None:
                c_n.append(c)
        x = torch.cat(outs, -1) if dirs > 1 else outs[0]
        if dropout and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, train)
    out = x.transpose(0, 1) if batch_first else x
    return out, torch.stack(h_n), (torch.stack(c_n) if c_n else None)


def _dims(args):
    (input, weight, _stride0, _wbuf, hx, _cx, mode, hidden, proj, layers, batch_first, _dropout, train,
     bidirectional, batch_sizes) = args[:15]
    t, b = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    return input, weight, mode, hidden, proj, layers, batch_first, train, (2 if bidirectional else 1), t, b


def reserve_bytes(args) -> int:
    input, _w, mode, hidden, _proj, layers, _bf, train, dirs, t, b = _dims(args)
    if not train:
        return 0
    values = dirs * t * b * hidden
    mask_bits = (layers - 1) * values if args[11] > 0 else 0
    return (RESERVE_PER_LAYER[mode] * layers - 1) * values * input.element_size() + 256 + mask_bits // 8


def dropout_state_bytes(args, sm_count: int) -> int:
    """cuDNN's dropout state, allocated by the first training call with dropout (0: none)."""
    dropout, train = args[11], args[12]
    return sm_count * DROPOUT_STATE_PER_SM if (train and dropout > 0) else 0


def workspace_bytes(args) -> int:
    """cuDNN's RNN workspace (forward, and each of backward's data and weight passes), fitted to
    276 fp32/fp16 shapes measured on an H200 (tests/data/cudnn_rnn_h200.json and the wide grid of
    tools/gpu/rnn_facts.py): the input projections of every step (``gates`` values per direction,
    step, sample and hidden unit) plus 2.5 more such values, one more when dropout runs between
    layers, and per layer and direction 9 MiB plus four copies' worth of an ``H x H`` matrix.
    cuDNN picks its algorithm by shape, so this is a fit: median error 10%, 90% of shapes within
    36%, worst 70%."""
    input, _w, mode, hidden, _proj, layers, _bf, _train, dirs, t, b = _dims(args)
    values = dirs * t * b * hidden
    dropout = values if (args[11] > 0 and layers > 1) else 0
    e = input.element_size()
    per_layer = WORKSPACE_PER_LAYER + 4 * hidden * hidden * e
    return int(((GATES[mode] + 2.5) * values + dropout) * e) + layers * dirs * per_layer


def forward(func, args, kwargs, book):
    """``_cudnn_rnn``: the meta outputs, the weight buffer and reserve the CUDA kernel returns,
    and its transient copies and workspace (booked through ``book``)."""
    out = func(*args, **kwargs)
    input, weight, *_ = _dims(args)
    batch_first = args[10]
    wbuf = out[4]
    if wbuf is None:
        # On a GPU the weights are already one flat buffer that the kernel uses in place:
        # nn.LSTM/GRU flatten their parameters when moved to CUDA, and under autocast
        # _cudnn_rnn_cast_reflatten casts them into one fresh buffer (the casts memfit traces).
        # Fake tensors cannot be flat (no data pointers), so the buffer autograd keeps is a view
        # of the first weight, expanded to the flat size: no new memory.
        wbuf = weight[0].reshape(-1)[:1].expand(sum(w.numel() for w in weight))
    reserve = out[3]
    nres = reserve_bytes(args)
    if nres:
        reserve = torch.empty(nres, dtype=torch.uint8, device=input.device)
    scratch = [("cudnn rnn workspace", workspace_bytes(args))]
    if batch_first and input.shape[0] > 1 and input.shape[1] > 1:
        scratch.insert(0, ("cudnn rnn input copy", input.numel() * input.element_size()))
    book(scratch)
    output = out[0]
    if batch_first and output.dim() == 3 and output.is_contiguous():
        # RNN.cpp computes [T, B, D] and returns ``output.transpose_(0, 1)``: a batch-first output is
        # not contiguous, so a Linear after it takes matmul's mm + add, not addmm (cuBLASLt)
        b, t, d = output.shape
        output = output.as_strided((b, t, d), (d, b * d, 1))
    return (output, out[1], out[2], reserve, wbuf)


def backward(func, args, kwargs, book):
    """``_cudnn_rnn_backward`` (no meta kernel): dx, dhx, dcx and the flat weight gradient, with
    the copies and workspaces of its data and weight passes."""
    (input, weight, stride0, weight_buf, hx, cx, output, grad_output, grad_hy, grad_cy, mode, hidden, proj, layers,
     batch_first, dropout, train, bidirectional, batch_sizes, dropout_state, reserve, output_mask) = args[:22]
    fwd_args = (input, weight, stride0, weight_buf, hx, cx, mode, hidden, proj, layers, batch_first, dropout, train,
                bidirectional, batch_sizes)
    ws = workspace_bytes(fwd_args)
    copies = []
    if batch_first and input.shape[0] > 1 and input.shape[1] > 1:
        copies.append(("cudnn rnn input copy", input.numel() * input.element_size()))
        if grad_output is not None:
            copies.append(("cudnn rnn grad copy", grad_output.numel() * grad_output.element_size()))
    dx = torch.empty_like(input) if output_mask[0] else None
    dhx = torch.empty_like(hx) if output_mask[1] else None
    dcx = torch.empty_like(cx) if (output_mask[2] and cx is not None) else None
    book(copies + [("cudnn rnn backward workspace", ws)])
    dw = []
    if output_mask[3]:
        flat = torch.zeros(sum(w.numel() for w in weight), dtype=weight[0].dtype, device=input.device)
        book(copies[:1] + [("cudnn rnn backward workspace", ws)])
        offset = 0
        for w in weight:
            dw.append(flat[offset:offset + w.numel()].view(w.shape))
            offset += w.numel()
    return dx, dhx, dcx, dw
