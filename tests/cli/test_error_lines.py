"""An `error:` line is a line of its own: a progress line is written whole (text and newline in
one write, a signal held until it is out), and an error after a line left open starts afresh.
Once seen: `... 4.9 serror: interrupted (SIGTERM)`, the signal having landed between a progress
line's text and its newline."""

from __future__ import annotations

import os
import signal

import pytest
import typer

from sparknet import interrupts
from sparknet.cli.common import Caught, fail
from sparknet.cli.common import interrupts as handling
from sparknet.cli.train import _line
from sparknet.errors import SparknetError


class _Stream:
    """stderr whose first write sends this process `signum` (a real signal, handled when the
    write returns) or raises `error` after half the text."""

    def __init__(self, signum: int | None = None, error: OSError | None = None) -> None:
        self.text = ""
        self.signum, self.error = signum, error

    def write(self, text: str) -> int:
        if self.error is not None:
            self.text += text[: len(text) // 2]
            error, self.error = self.error, None
            raise error
        self.text += text
        if self.signum is not None:
            signum, self.signum = self.signum, None
            os.kill(os.getpid(), signum)
        return len(text)

    def flush(self) -> None:
        pass


def test_a_signal_during_a_progress_line_leaves_the_error_its_own_line(monkeypatch):
    stream = _Stream(signum=signal.SIGTERM)
    monkeypatch.setattr("sys.stderr", stream)
    caught = Caught()
    with pytest.raises(KeyboardInterrupt), handling(caught):
        _line("round 3/9  loss 0.1234  812 samples/s  4.9 s")
    assert caught.signum == signal.SIGTERM
    with pytest.raises(typer.Exit):
        fail(SparknetError("interrupted (SIGTERM); Spark stopped"), debug=False, code=143)
    assert stream.text.splitlines() == [
        "round 3/9  loss 0.1234  812 samples/s  4.9 s",
        "error: interrupted (SIGTERM); Spark stopped",
    ]


def test_an_error_after_a_line_left_open_starts_on_a_fresh_line():
    stream = _Stream(error=OSError(5, "Input/output error"))
    with pytest.raises(OSError):
        interrupts.write_line(stream, "round 1/2  loss 2.3000")
    interrupts.write_line(stream, "error: the run dir is full")
    assert stream.text == "round 1/2  \nerror: the run dir is full\n"  # half, then its own line
