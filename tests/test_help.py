"""``--help`` works on every subcommand and lists its keys or flags with their defaults (exit 0)."""

import re

import pytest
from conftest import run_cli

from longsft.launch import cli

# command -> what its help must show: a key=value default, or an option's "(default: ...)"
HELP = {
    ("train",): ["optim.lr=5.0e-06", "optim.betas=[0.9, 0.999]", "stages.N.seq_len=2048", "parallel.sp_backend=torch"],
    ("config",): ["--get KEY", "parallel.sp_size=1"],
    ("plan",): ["(default: 79.0)", "(default: 8)", "optim.grad_accum=1"],
    ("submit",): ["(default: 1)", "--dry-run", "deepspeed.config=zero3_offload"],
    ("status",): ["run_dir"],
    ("report",): ["(default: 2000)"],
    ("sweep",): ["(default: train)"],
    ("eval",): ["max_new_tokens=512", "backend=hf"],
    ("serve",): ["max_queue=64", "port=8000"],
    ("constory",): ["max_story_chars=60000"],
    ("constory", "generate"): ["target_words=8000"],
    ("score",): ["(default: wrong)", "(default: 2000)"],
    ("vote",): ["an odd number, at least 3", "(default: 2000)"],
    ("data",): ["prepare", "sample", "extend", "ablation", "erhg", "mma"],
    ("data", "prepare"): ["--workers", "data.cache_dir=null", "stages.N.seq_len=2048"],
    ("data", "sample"): ["(default: 512,1k,2k,4k)", "(default: 16)"],
    ("data", "extend"): ["(default: 16k,32k,64k,100k)", "(default: qwen)"],
    ("data", "ablation"): ["(default: all)", "(default: 20)"],
    ("data", "erhg"): ["(default: rules)", "(default: 0.3)"],
    ("data", "mma"): ["(default: 1)"],
}


@pytest.mark.parametrize("argv", sorted(HELP), ids=" ".join)
def test_help_of_every_command_lists_its_defaults(capsys, argv):
    try:
        code, out, err = run_cli(capsys, *argv, "--help")
    except SystemExit as e:  # argparse commands answer --help by exiting 0
        code, (out, err) = e.code, capsys.readouterr()
    assert code == 0 and not err, err
    flat = " ".join(out.split())  # argparse wraps lines at the terminal's width
    for shown in HELP[argv]:
        assert shown in flat, f"longsft {' '.join(argv)} --help does not show {shown!r}"


def test_every_command_has_a_help_test_and_the_argument_rule_is_stated(capsys):
    listed = {m.group(1) for m in re.finditer(r"^    longsft (\w+)", cli.__doc__, re.M)}
    assert listed == {argv[0] for argv in HELP}
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "key=value" in out and "--flags" in out
