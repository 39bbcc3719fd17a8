"""What the GPU-preset planner leaves out or traces ahead without a trace of its own: plans whose
weights alone are over the budget (a certain lower bound), and, for optimizers that compile a graph
per weight dtype (torchao's), the weight dtypes the walk will meet."""

from types import SimpleNamespace

from memfit.planner.gpu_time import GpuStepModel
from memfit.planner.space import SearchSpace, weights_on_device, within_weights
from memfit.plans import Plan

N = 6_738_415_616  # Llama-2-7B's parameters
GiB = 2**30


def test_weights_on_the_device_by_precision_and_where_a_technique_moves_them():
    assert weights_on_device(Plan(precision="fp32"), N) == 4 * N
    assert weights_on_device(Plan(precision="bf16"), N) == 4 * N  # autocast keeps fp32 weights
    assert weights_on_device(Plan(precision="bf16-pure"), N) == 2 * N
    assert weights_on_device(Plan(precision="bf16", adapter="lora", base_weights="nf4"), N) is None  # quantized base
    assert weights_on_device(Plan(precision="bf16", shard="fsdp", world_size=2), N) is None  # sharded
    assert weights_on_device(Plan(precision="bf16", shard="fsdp", world_size=2, shard_offload=True), N) is None


def test_plans_whose_weights_alone_do_not_fit_leave_the_search_with_a_note():
    space = SearchSpace()
    plans = [Plan(precision=p, optimizer=o) for p in ("fp32", "bf16", "bf16-pure") for o in ("adamw", "adamw8bit")]
    kept = within_weights(plans, N, int(21.28 * GiB), space)
    assert [p.precision for p in kept] == ["bf16-pure", "bf16-pure"]
    assert len(space.notes) == 2 and "precision=bf16: its fp32 weights alone need 25.10 GiB > budget 21.28 GiB" \
        in space.notes[1]
    # a budget above fp32 weights keeps every plan, and says nothing
    space = SearchSpace()
    assert within_weights(plans, N, 80 * GiB, space) == plans and not space.notes


def test_torchao_optimizers_are_traced_ahead_at_each_weight_dtype_searched():
    space = SearchSpace(values={"precision": ["fp32", "bf16", "bf16-pure"],
                                "optimizer": ["adamw", "adamw8bit", "adamw8bit-ao", "adamw4bit-ao"]})
    model = SimpleNamespace(space=space)
    base = Plan(precision="bf16")
    alone = [base.replace(optimizer=o) for o in ("adamw8bit", "adamw8bit-ao", "adamw4bit-ao")]
    alone.append(base.replace(precision="bf16-pure"))
    warm = GpuStepModel._warming(model, alone)
    # fp32 and bf16 autocast hold fp32 weights (the alone plans' own): only bf16-pure is new
    assert warm == [base.replace(optimizer="adamw8bit-ao", precision="bf16-pure"),
                    base.replace(optimizer="adamw4bit-ao", precision="bf16-pure")]
