"""memfit estimate on the command line: plan flags, the timeline and the module table."""

import pytest

from memfit.cli.main import main

pytestmark = pytest.mark.integration


def test_timeline_png_and_module_table(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert main(["estimate", "mha", "-b", "2", "--timeline", str(png), "--modules", "4"]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "by module" in out and "MHAModel.blocks.0.attn" in out
    assert main(["estimate", "mha", "-b", "2", "--timeline", str(tmp_path / "no" / "t.png")]) == 2


def test_max_grad_norm_on_the_command_line(capsys):
    assert main(["estimate", "mha", "-b", "2", "--max-grad-norm", "1.0", "--json"]) == 0
    assert '"max_grad_norm": 1.0' in capsys.readouterr().out
    assert main(["estimate", "mha", "-b", "2", "--max-grad-norm", "lots"]) == 2
    assert "--max-grad-norm 'lots' is not a number" in capsys.readouterr().err
