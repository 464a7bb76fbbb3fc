"""The ground floor's error helpers, on made-up errors (no Spark, no AWS)."""

from __future__ import annotations

from sparknet.errors import SparknetError, first_line


class _Gone(Exception):
    """An error whose text cannot be had, as a Py4J error's once its JVM is gone."""

    def __str__(self) -> str:
        raise ConnectionError("the JVM is gone")


def test_first_line_is_the_first_line_with_text_else_the_type():
    assert first_line(ValueError("\n\n  bad value  \nat line 2")) == "bad value"
    assert first_line(SparknetError("lower {@workers}")) == "lower --workers"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(_Gone()) == "_Gone"


def test_details_show_under_the_message_and_cross_a_process():
    """A failed node's output lines are the error's `details`: `str` ends with them, the one
    line that says what to fix (`first_line`, a wrapping template's `{cause:line}`) has none,
    and they survive pickling (a task's error) and respelling (`fit()`)."""
    import pickle

    from sparknet.errors import as_keyword

    exc = SparknetError("lower {@workers}").with_details(["--- master:", "  oops"])
    assert str(exc) == "lower --workers\n--- master:\n  oops"
    assert first_line(exc) == "lower --workers"
    wrapped = SparknetError("{cause:line}; {stay}", cause=exc, stay="kept")
    assert str(wrapped) == "lower --workers; kept"
    back = pickle.loads(pickle.dumps(exc))
    assert back.details == ("--- master:", "  oops")
    assert str(back.respell(as_keyword)) == "lower workers=\n--- master:\n  oops"
