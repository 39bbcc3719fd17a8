"""``--device`` as people write a card: 'rtx-3090', 'RTX 4090' and 'NVIDIA GeForce RTX 4090' were unknown devices."""

import pytest

from memfit.devices import get_device
from memfit.errors import UserError


@pytest.mark.parametrize("name,preset", [("rtx-3090", "rtx3090"), ("RTX 4090", "rtx4090"),
                                         ("NVIDIA GeForce RTX 4090", "rtx4090"), ("H100", "h100-80gb"),
                                         ("a100 40GB", "a100-40gb"), ("RTX 4060 Ti 16GB", "rtx4060ti-16gb"),
                                         ("RTX A6000", "rtxa6000"), ("4090", "rtx4090"), ("l40s", "l40s")])
def test_a_card_is_found_as_people_write_its_name(name, preset):
    assert get_device(name).name == preset


def test_an_unknown_card_lists_the_presets():
    with pytest.raises(UserError, match="unknown device 'rtx 9090'; choose cpu or one of: h100-80gb, "):
        get_device("rtx 9090")
