"""The one vocabulary of memory categories used everywhere (reports, JSON, planner), and the
steady-state step whose peak every report gives."""

STEADY_STEP = 2
"""Reports give the peak of this step: optimizer states do not exist during the first."""

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "temporaries", "inputs", "communication",
              "other")

DESCRIPTIONS = {
    "parameters": "model weights",
    "gradients": ".grad of the parameters",
    "optimizer_states": "optimizer state (e.g. Adam moments)",
    "activations": "forward results kept alive for backward",
    "temporaries": "short-lived results (recomputation, backward and optimizer intermediates)",
    "inputs": "the batch",
    "communication": "FSDP2 buffers: gathered parameters, gradients before their reduce-scatter",
    "other": "buffers, allocator and library overheads",
}
