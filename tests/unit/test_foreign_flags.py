"""Other tools' flags answered with memfit's, in one line (memfit.cli.foreign_flags): ``--bf16`` was read as a
prefix of ``--bf16-update`` ("expected one argument"), ``--optim`` as ambiguous, ``--gradient_checkpointing``
and ``--load_in_4bit`` as unrecognized with no hint."""

import pytest

from memfit.cli.foreign_flags import THEIRS
from memfit.cli.main import build_parser, main


def test_no_foreign_flag_is_one_of_memfits():
    parser = build_parser()
    ours = {option for sub in parser._subparsers._group_actions[0].choices.values()
            for action in sub._actions for option in action.option_strings}
    assert not ours & set(THEIRS), ours & set(THEIRS)
    assert all(flag == flag.replace("_", "-") for flag in THEIRS)  # (underscored spellings are matched as dashed)


@pytest.mark.parametrize("argv,said", [
    (["estimate", "gpt2", "-b", "8", "--bf16", "--device", "rtx4090"], "--bf16 is another tool's flag; memfit's: --precision bf16"),
    (["plan", "gpt2", "--optim", "adamw8bit"], "--optim is another tool's flag; memfit's: --optimizer NAME"),
    (["estimate", "llama", "--gradient_checkpointing"], "--gradient_checkpointing is another tool's flag; memfit's: "
                                                        "--checkpointing blocks"),
    (["fit", "llama", "--load_in_4bit=true"], "--load_in_4bit is another tool's flag; memfit's: --base-weights nf4"),
    (["estimate", "dit-flux", "--blocks_to_swap", "10"], "--blocks_to_swap is another tool's flag; memfit's: --swap-blocks N"),
])
def test_another_tools_flag_is_answered_with_memfits(capsys, argv, said):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"memfit {argv[0]}: error: {said}" in err, err
