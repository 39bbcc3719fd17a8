"""FSDP2 on a mixture of experts: one of two real gloo ranks on this CPU peaks where the
fake-process-group trace predicts (the experts' 3-D weights sharded along the experts)."""

import json
import socket

import pytest
import torch
import torch.multiprocessing as mp

from memfit.memory.estimate import estimate
from memfit.plans import Plan
from memfit.workloads.small_configs import write_folder

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CASES = {"mixtral": {"world_size": 2},
         "qwen2_moe": {"world_size": 2, "precision": "bf16", "checkpointing": "blocks",
                       "adapter": "lora:r=8,params=experts.gate_up_proj+experts.down_proj"}}
BATCH, SEQ = 4, 64


def _rank(rank: int, world: int, port: int, out: str, folders: dict) -> None:
    import os

    import torch.distributed as dist

    from memfit.memory.measure import measured_cpu_run
    from memfit.target import Target

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        peaks = {}
        for name, fields in CASES.items():
            _, peaks[name] = measured_cpu_run(Target.resolve(folders[name], Plan(**fields), BATCH, "cpu", seq_len=SEQ))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(peaks, f)
    finally:
        dist.destroy_process_group()


def test_a_ranks_peak_is_predicted(tmp_path):
    folders = {name: write_folder(name, tmp_path) for name in CASES}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.json")
    mp.start_processes(_rank, args=(2, port, out, folders), nprocs=2, start_method="spawn")
    with open(out) as f:
        measured = json.load(f)
    for name, fields in CASES.items():
        predicted = estimate(folders[name], Plan(**fields), batch_size=BATCH, device="cpu", seq_len=SEQ)
        assert measured[name] == pytest.approx(predicted.peak_bytes, rel=0.01), (name, measured[name])
