"""Progress in a log file is whole lines; on a terminal it is tqdm's bar."""

import io

from dflop.progress import PlainProgress, library_bars_off_in_logs, progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_file_gets_a_line_per_tenth_and_no_carriage_returns():
    out = io.StringIO()
    with progress(50, "profile_data", "sample", file=out) as bar:
        for _ in range(50):
            bar.update()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert [line.split()[1] for line in lines] == [f"{5 * k}/50" for k in range(1, 11)]
    assert lines[-1].startswith("profile_data: 50/50 sample (100%) ")


def test_updates_of_several_at_once_and_a_resumed_start():
    out = io.StringIO()
    bar = progress(10, "train", "step", file=out, initial=4)
    bar.update(3)  # 4 -> 7 crosses 5, 6 and 7: one line
    bar.close()  # 7 was already written: nothing more
    (line,) = out.getvalue().splitlines()
    assert line.startswith("train: 7/10 step (70%) ")


def test_unknown_total_writes_at_close_only_within_the_interval():
    out = io.StringIO()
    bar = PlainProgress(None, "profile_data", "sample", file=out, interval_s=3600)
    bar.update(7)
    assert out.getvalue() == ""
    bar.close()
    assert out.getvalue().startswith("profile_data: 7 sample ")


def test_disabled_writes_nothing_and_a_terminal_gets_tqdm():
    out = io.StringIO()
    with progress(3, "x", "step", file=out, enabled=False) as bar:
        bar.update(3)
    assert out.getvalue() == ""
    term = _Terminal()
    with progress(3, "x", "step", file=term) as bar:
        assert type(bar).__module__.startswith("tqdm")
        bar.update(3)
    assert "\r" in term.getvalue()


def test_plain_false_is_silent_off_a_terminal_only():
    out, term = io.StringIO(), _Terminal()
    for file in (out, term):
        with progress(2, "train", "step", file=file, plain=False) as bar:
            bar.update(2)
    assert out.getvalue() == "" and "2/2" in term.getvalue()


def test_transformers_bars_are_off_inside_for_a_log_and_on_again_after():
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    with library_bars_off_in_logs(io.StringIO()):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    with library_bars_off_in_logs(_Terminal()):
        assert hf_logging.is_progress_bar_enabled()
