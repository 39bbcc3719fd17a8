"""Names as people write them. ``--device``: 'rtx-3090', 'RTX 4090' and 'NVIDIA GeForce RTX 4090' were unknown
devices. A workload: 'mistral' or 'flux' were unknown workloads, with no word of hub ids."""

import pytest

from memfit.devices import get_device
from memfit.errors import UserError
from memfit.workloads import load_workload


@pytest.mark.parametrize("name,preset", [("rtx-3090", "rtx3090"), ("RTX 4090", "rtx4090"),
                                         ("NVIDIA GeForce RTX 4090", "rtx4090"), ("H100", "h100-80gb"),
                                         ("a100 40GB", "a100-40gb"), ("RTX 4060 Ti 16GB", "rtx4060ti-16gb"),
                                         ("RTX A6000", "rtxa6000"), ("4090", "rtx4090"), ("l40s", "l40s")])
def test_a_card_is_found_as_people_write_its_name(name, preset):
    assert get_device(name).name == preset


def test_an_unknown_card_lists_the_presets():
    with pytest.raises(UserError, match="unknown device 'rtx 9090'; choose cpu or one of: h100-80gb, "):
        get_device("rtx 9090")


@pytest.mark.parametrize("name,said", [
    ("mistral", "unknown workload 'mistral'; did you mean mistralai/Mistral-7B-v0.3 (a hub id)? or choose a built-in"),
    ("flux", "unknown workload 'flux'; did you mean dit-flux (a built-in)? or choose"),
    ("gpt-2", "did you mean gpt2 (a built-in)?"),
    ("nosuch", "unknown workload 'nosuch'; choose a built-in (gpt2, "),
])
def test_an_unknown_workload_suggests_the_built_in_or_hub_id_meant(name, said):
    with pytest.raises(UserError, match=said.replace("?", r"\?").replace("(", r"\(").replace(")", r"\)")) as e:
        load_workload(name)
    assert "a Hugging Face hub id (org/name" in str(e.value)
