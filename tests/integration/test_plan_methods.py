"""memfit plan --methods: full fine-tuning and adapters side by side, only when asked."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_cli_errors import run

from memfit.errors import UserError
from memfit.planner.methods import parse_methods

pytest.importorskip("peft")

TINY = ("llama:num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
        "num_key_value_heads=4,vocab_size=500")


def test_methods_are_ranked_side_by_side_and_said_to_train_different_things():
    code, out, _ = run(["plan", TINY, "--seq-len", "32", "-b", "2", "--methods", "full,lora", "--device",
                        "h100-80gb", "--max-traces", "4", "--optimizers", "adamw", "--json"])
    assert code == 0
    data = json.loads(out)
    assert "train different things" in data["note"]
    rows = {m["method"]: m for m in data["methods"]}
    assert rows["full"]["chosen"]["plan"]["adapter"] == "none"
    assert rows["lora"]["chosen"]["plan"]["adapter"] == "lora:r=16"
    # 1 layer x (q_proj, v_proj) x r=16 x (64 in + 64 out)
    assert rows["lora"]["trainable_parameters"] == 2 * 16 * 128
    assert rows["full"]["trainable_parameters"] > 20 * rows["lora"]["trainable_parameters"]
    for row in rows.values():  # each search's traces, by phase and kind (issue 49: where the time goes)
        counts = {k: n for k, (n, _) in row["trace_seconds"].items() if not k.endswith("replay")}
        assert sum(counts.values()) == row["traces"] and any(k.endswith(": full-depth") for k in counts)


def test_the_planner_never_changes_the_method_by_itself():
    code, out, _ = run(["plan", TINY, "--seq-len", "32", "-b", "2", "--device", "h100-80gb", "--max-traces", "4",
                        "--optimizers", "adamw", "--json"])
    assert code == 0
    ranked = json.loads(out)["ranked"]
    assert ranked and all(r["plan"]["adapter"] == "none" and r["plan"]["base_weights"] == "as-is" for r in ranked)


def test_methods_take_the_users_adapter_settings():
    methods = {m.name: m.keys for m in parse_methods("lora,dora,qlora,qdora", "lora:r=4,targets=q_proj")}
    assert methods["lora"] == {"adapter": "lora:r=4,targets=q_proj", "base_weights": "as-is"}
    assert methods["dora"]["adapter"] == "dora:r=4,targets=q_proj"
    assert methods["qlora"] == {"adapter": "lora:r=4,targets=q_proj", "base_weights": "nf4"}
    assert methods["qdora"] == {"adapter": "dora:r=4,targets=q_proj", "base_weights": "nf4"}


def test_qdora_is_planned_on_fake_tensors_beside_qlora():
    """QDoRA (DoRA over NF4 weights) traces on fake tensors (NOTE [ bitsandbytes parameters on fake
    tensors ]): its row is a plan, and DoRA's magnitudes make it train more than QLoRA."""
    code, out, _ = run(["plan", TINY, "--seq-len", "32", "-b", "2", "--methods", "qlora,qdora", "--device",
                        "h100-80gb", "--max-traces", "4", "--optimizers", "adamw", "--json"])
    assert code == 0
    rows = {m["method"]: m for m in json.loads(out)["methods"]}
    assert rows["qdora"]["chosen"]["plan"]["adapter"].startswith("dora:") and rows["qdora"]["chosen"]["plan"][
        "base_weights"] == "nf4"
    # DoRA adds one magnitude per output feature of each adapted layer (q_proj, v_proj: 64 + 64)
    assert rows["qdora"]["trainable_parameters"] == rows["qlora"]["trainable_parameters"] + 64 + 64


@pytest.mark.parametrize("text,problem", [("full,prefix", "unknown method 'prefix'"), ("lora,lora", "named twice"),
                                          (",", "give some of")])
def test_bad_methods_get_one_line(text, problem):
    with pytest.raises(UserError, match=problem):
        parse_methods(text)
    code, _, err = run(["plan", TINY, "--methods", text])
    assert code == 2 and problem.split("'")[0] in err and err.count("\n") <= 1


def test_an_adapter_s_few_trained_parameters_leave_the_optimizer_as_the_workload_s():
    """NOTE [ Optimizer choices that cannot matter ]: a LoRA's gradients and states are a sliver of
    the budget, so no low-bit states, in-backward step or state offload is searched (they would
    change numerics or add work to save next to nothing)."""
    code, out, _ = run(["plan", TINY, "--seq-len", "32", "-b", "2", "--methods", "full,lora", "--device",
                        "h100-80gb", "--max-traces", "4", "--json"])  # (torchao's compiles: cached after one run)
    assert code == 0
    rows = {m["method"]: m for m in json.loads(out)["methods"]}
    lora = rows["lora"]
    assert any("not searched" in n and "% of the budget" in n for n in lora["notes"])
    assert all(r["plan"]["optimizer"] == "adamw" and not r["plan"]["optimizer_in_backward"]
               and not any(o.startswith("optimizer_states") for o in r["plan"]["offload"]) for r in lora["ranked"])
    # (the full fine-tune of this tiny model is narrowed too: its states are a sliver of an H100;
    # a model whose states are not keeps its optimizer choices: test_the_optimizer_keys_are_fixed_only_...)


def test_the_optimizer_keys_are_fixed_only_when_small_and_not_the_users():
    from memfit.planner.space import SearchSpace, leave_out_optimizer_choices
    def space():
        return SearchSpace(values={"optimizer": ["adamw", "adamw8bit-ao"], "optimizer_in_backward": [False, True],
                                   "offload": [(), ("optimizer_states",), ("activations",)]}, micro_batches=[1])
    small = space()
    assert leave_out_optimizer_choices(small, 1_000_000, 20 << 30, keep=set())
    assert small.values == {"optimizer": ["adamw"], "optimizer_in_backward": [False],
                            "offload": [(), ("activations",)]}
    big = space()
    assert not leave_out_optimizer_choices(big, 1_000_000_000, 20 << 30, keep=set())
    assert big.values == space().values
    users = space()
    leave_out_optimizer_choices(users, 1_000_000, 20 << 30, keep={"optimizer"})
    assert users.values["optimizer"] == ["adamw", "adamw8bit-ao"]


@pytest.mark.slow  # (keeps the default suite under 10 minutes on 2 cores)
def test_when_nothing_fits_with_the_optimizer_fixed_the_plan_searches_it_again(monkeypatch):
    """No answer is lost: the narrowed search found nothing, so the whole space is searched."""
    from memfit.planner import search
    calls = []
    real = search.plan

    def spy(*args, **kwargs):
        calls.append(kwargs.get("narrow_optimizer", True))
        return real(*args, **kwargs)
    monkeypatch.setattr(search, "plan", spy)
    result = spy(TINY, budget="528MiB", device="h100-80gb", batch_size=2, seq_len=32, max_traces=4,
                 fixed={"adapter": "lora:r=16"}, optimizers=("adamw", "adamw8bit"))
    assert result.chosen is None and calls == [True, False]
    assert not any("not searched" in n for n in result.notes)


def test_a_narrowed_search_that_found_nothing_is_searched_again_on_its_own_traces(monkeypatch):
    """NOTE [ Optimizer choices that cannot matter ]: when the narrowed search finds nothing, the whole
    space is searched on the same book of traces: what the first search traced is not traced again, and
    the traces are counted once."""
    from memfit.planner import search
    calls, books, real_plan, real_search = [], [], search.plan, search._search

    def spy(*args, **kwargs):
        calls.append(kwargs.get("narrow_optimizer", True))
        return real_plan(*args, **kwargs)

    def nothing_first(*args):
        result = real_search(*args)
        books.append((args[12], args[12].traces))
        if len(books) == 1:  # (as if nothing had fitted)
            result.chosen = None
        return result
    monkeypatch.setattr(search, "plan", spy)
    monkeypatch.setattr(search, "_search", nothing_first)
    result = spy(TINY, device="h100-80gb", batch_size=2, seq_len=32, max_traces=4, fixed={"adapter": "lora:r=16"})
    assert calls == [True, False] and books[0][0] is books[1][0]
    assert len({c.plan.optimizer for c in result.candidates}) > 1 and result.chosen is not None
    # the book keeps each trace (a job traced is not traced again), and the traces are counted once
    assert result.traces == books[1][1] > books[0][1]


def test_each_method_s_search_shows_its_progress_under_its_name(monkeypatch):
    """Issue 32: a progress bar with the traces done and left, for --methods too (one bar, named by
    the method being planned)."""
    import io

    from memfit.planner import search, side_by_side
    from memfit.planner.progress import PlanProgress
    seen, real = [], search.plan
    # in turn, in this process, where the spy sees them (forked, they run so only once this process
    # has run a backward pass: whether a test before this one did must not decide what this one sees)
    monkeypatch.setattr(side_by_side, "can_fork_searches", lambda: False)

    def spy(*args, progress=None, **kwargs):
        seen.append(progress.label if progress is not None else None)
        return real(*args, progress=progress, **kwargs)
    monkeypatch.setattr(search, "plan", spy)
    code, _, _ = run(["plan", TINY, "--seq-len", "32", "-b", "2", "--methods", "full,lora", "--device",
                      "h100-80gb", "--max-traces", "4", "--optimizers", "adamw"])
    assert code == 0 and seen == ["full", "lora"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    terminal = Terminal()
    with PlanProgress(terminal) as bar:
        bar.label = "qlora"
        bar.walk(3, 60, 12)
    assert "qlora: traces" in terminal.getvalue()


def test_a_model_the_user_froze_leaves_the_optimizer_as_the_workload_s_too():
    """The same rule for a model that arrives mostly frozen (a PEFT model of the user's own): its
    meta model's requires_grad says how few parameters train."""
    from memfit.planner.search import plan
    from memfit.workloads import load_workload
    base = load_workload(TINY, seq_len=32)

    def frozen():
        model = base.model()
        for name, p in model.named_parameters():
            p.requires_grad_("norm" in name)
        return model
    result = plan(dataclasses.replace(base, model=frozen), device="h100-80gb", batch_size=2, max_traces=4)
    assert any("not searched" in n for n in result.notes)
    assert {c.plan.optimizer for c in result.candidates} == {"adamw"}


@pytest.mark.slow  # (15 s: keeps the default suite under 10 minutes; the unit tier keeps a precision left out
def test_a_method_whose_weights_alone_exceed_the_budget_is_a_row_and_the_others_are_planned():  # for its weights)
    """Mixtral's --methods full,lora,qlora on a 24 GB card waited for every search, then failed as a
    whole on full fine-tuning's weights (9.5 minutes). Here full fine-tuning needs the model's 4.49 MiB
    of 16-bit weights on the device, over a 3 MiB budget; QLoRA's NF4 linears take a quarter of
    that, so it is searched."""
    tiny2 = TINY.replace("num_hidden_layers=1,hidden_size=64,intermediate_size=128", "num_hidden_layers=2,hidden_size=256,"
                         "intermediate_size=1024")
    code, out, _ = run(["plan", tiny2, "--seq-len", "32", "-b", "2", "--methods", "full,qlora", "--device", "h100-80gb",
                        "--budget", "3MiB", "--max-traces", "2", "--optimizers", "adamw", "--json"])
    assert code == 1
    rows = {m["method"]: m for m in json.loads(out)["methods"]}
    full, qlora = rows["full"], rows["qlora"]
    assert full["chosen"] is None and full["least_bytes"] == 2 * 2_354_432 and not full["ranked"]
    assert "below the model's own parameters" in full["notes"][0]
    assert qlora["least_bytes"] is None and qlora["traces"] > 0 and qlora["ranked"]


def test_the_weights_every_plan_keeps_count_quantized_linears_in_their_format():
    """A 4-bit QLoRA of a large model is not refused for its 16-bit size (Llama-2-70B on a 48 GB
    card: 128 GiB in 16 bits, about 35 GiB with NF4 linears)."""
    from memfit.devices import get_device
    from memfit.errors import WeightsExceedBudget
    from memfit.planner.space import model_facts
    from memfit.planner.weight_floor import check_budget_above_weights
    from memfit.workloads import load_workload
    facts = model_facts(load_workload(TINY.replace("num_hidden_layers=1", "num_hidden_layers=4"), seq_len=32))
    dev = get_device("h100-80gb")
    linear = sum(m.weight.numel() for m in facts.model.modules()
                 if type(m) is torch.nn.Linear and m is not facts.model.lm_head)
    sixteen = 2 * facts.n_params
    nf4 = sixteen - 2 * linear + linear // 2
    for base, need in (("as-is", sixteen), ("nf4", nf4), ("nf4:double_quant=true", nf4), ("int8", sixteen - linear)):
        with pytest.raises(WeightsExceedBudget) as refused:
            check_budget_above_weights(need - 1, facts, dev, base_weights=base)
        assert refused.value.needs_bytes == need
        check_budget_above_weights(need, facts, dev, base_weights=base)
    block = 2 * sum(p.numel() for p in facts.model.model.layers[0].parameters())
    with pytest.raises(WeightsExceedBudget) as refused:  # (an adapter: two of the four blocks can be swapped out)
        check_budget_above_weights(sixteen - 2 * block - 1, facts, dev, adapter="lora:r=16")
    assert refused.value.needs_bytes == sixteen - 2 * block
