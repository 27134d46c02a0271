"""The `dflop` command's help: every option explained, descriptions without markup, working hints."""

import argparse

from dflop.cli import build_parser, main
from dflop.runtime.launch import build_parser as train_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "dflop"):
    """`parser` and, depth first, every subcommand's parser (`dflop train`'s is the launcher's)."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(train_parser() if sub_name == "train" else sub, f"{name} {sub_name}")


def test_every_option_and_argument_of_every_subcommand_has_help():
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, parser in _parsers(build_parser()) for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()]
    assert missing == []
    assert sum(1 for _ in _parsers(build_parser())) >= 15  # the walk reached the subcommands (and report's groups)


def test_descriptions_have_no_rst_markup():
    for name, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text and ":func:" not in text, name


def test_install_profile_hint_is_a_profile_snakemake_finds(tmp_path, monkeypatch, capsys):
    """The printed `snakemake --profile X` resolves, from where it was printed, to the copy
    (checked with Snakemake's own lookup)."""
    from snakemake.cli import get_profile_dir

    work = tmp_path / "checkout"
    work.mkdir()
    monkeypatch.chdir(work)
    for dest, expected in ((tmp_path / "elsewhere", str(tmp_path / "elsewhere" / "slurm")),
                           (work / "sub", "sub/slurm"), (work, "slurm")):
        assert main(["install-profile", "slurm", "--dest", str(dest)]) == 0
        out = capsys.readouterr().out
        argument = out.split("snakemake --profile ")[1].split()[0]
        assert argument == expected
        found = get_profile_dir(argument)
        assert found is not None and found[0].resolve() == (dest / "slurm").resolve(), out
