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
