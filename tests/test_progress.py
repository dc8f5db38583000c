"""revffn.progress: a bar on a terminal, throttled lines with an ETA on a log, nothing for short work."""

import io

from revffn.progress import clock, library_bars_off, progress


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_log_gets_throttled_lines_with_an_eta_and_the_last_state():
    out, now = io.StringIO(), Clock()
    with progress("calibrate", "pass", file=out, every=10, now=now) as bar:
        for done in range(1, 61):
            now.t = done * 1.0  # one pass a second
            bar(done, 60)
    lines = out.getvalue().splitlines()
    assert lines[0] == "revffn: calibrate [10/60 passes, 17%]; 10s elapsed, ETA 50s"
    assert len(lines) == 6  # at 10, 20, ..., 60 s: one every 10 s, the last one included
    assert lines[-1] == "revffn: calibrate [60/60 passes, 100%]; 1m00s elapsed"


def test_resumed_work_counts_its_rate_from_where_it_started():
    out, now = io.StringIO(), Clock()
    with progress("train", "step", 100, file=out, every=10, now=now, initial=50) as bar:
        for done in range(51, 61):
            now.t = (done - 50) * 1.0  # one step a second since the resume
            bar(done)
    assert out.getvalue().splitlines()[0] == "revffn: train [60/100 steps, 60%]; 10s elapsed, ETA 40s"


def test_short_work_prints_nothing_and_the_throttled_last_state_is_flushed():
    out, now = io.StringIO(), Clock()
    with progress("eval", "batch", file=out, every=10, now=now) as bar:
        for done in range(1, 4):
            now.t = done
            bar(done, 3)
    assert out.getvalue() == ""
    out, now = io.StringIO(), Clock()
    with progress("study", "run", file=out, every=10, now=now) as bar:
        now.t = 12
        bar(1, note="full seed 0: ok")  # no total: a count, no ETA
        now.t = 13
        bar(2, note="lora seed 0: ok")
    assert out.getvalue().splitlines() == ["revffn: study [1 runs] full seed 0: ok; 12s elapsed",
                                           "revffn: study [2 runs] lora seed 0: ok; 13s elapsed"]


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_tqdm_bar_and_disable_gets_nothing():
    out = Tty()
    with progress("heal", "step", 4, file=out) as bar:
        for done in range(1, 5):
            bar(done, 4, "KL 1.0")
    assert "heal" in out.getvalue() and "4/4" in out.getvalue()
    out = io.StringIO()
    with progress("heal", "step", file=out, every=0, disable=True) as bar:
        bar(1, 1)
    assert out.getvalue() == ""


def test_clock():
    assert (clock(8.2), clock(62.4), clock(3725)) == ("8s", "1m02s", "1h02m")


def test_per_run_lines_on_a_terminal_too():
    """bench, study and archs: every run's line, with the ETA, whatever stderr is."""
    out, now = Tty(), Clock()
    with progress("bench", "run", 4, file=out, every=0, now=now, bar=False) as bar:
        for done in range(1, 5):
            now.t = 30 * done
            bar(done, 4, f"m{done} ... ok")
    lines = out.getvalue().splitlines()
    assert lines[1] == "revffn: bench [2/4 runs, 50%] m2 ... ok; 1m00s elapsed, ETA 1m00s"
    assert len(lines) == 4


def test_transformers_bars_go_off_and_download_bars_stay_as_they_were(monkeypatch):
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    was = hub.are_progress_bars_disabled()
    for downloads_off in (False, True):
        monkeypatch.setattr(hf_logging, "_tqdm_active", True)
        (hub.disable_progress_bars if downloads_off else hub.enable_progress_bars)()
        library_bars_off()
        assert not hf_logging.is_progress_bar_enabled()
        assert hub.are_progress_bars_disabled() == downloads_off
    (hub.disable_progress_bars if was else hub.enable_progress_bars)()

