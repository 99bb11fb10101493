"""A 5xx tells the client what failed and an error id, never the exception's text (it can name hosts, processes and
another request's state); the log has the exception under the same id (serve/http_api.py)."""

from __future__ import annotations

import logging
import re

from s2d_ray.errors import RequestError, ServiceUnavailableError
from s2d_ray.serve.http_api import api_error


def test_a_5xx_carries_an_id_and_the_log_the_exception(caplog):
    caplog.set_level(logging.ERROR, logger="s2d_ray.serve.http_api")
    for exc, status, what in ((RuntimeError("node 10.0.0.7 pid 4242: boom"), 500, "internal error"),
                              (ServiceUnavailableError("RayActorError: actor at 10.0.0.7 died"), 503,
                               "service unavailable")):
        err = api_error(exc)
        m = re.fullmatch(rf"{what} \(error id ([0-9a-f]{{16}})\)", err.message)
        assert err.status == status and m, err.message
        record = next(r for r in caplog.records if m.group(1) in r.getMessage())
        assert record.exc_info[1] is exc  # the exception, with its traceback, under the client's id
    assert "10.0.0.7" not in api_error(RuntimeError("10.0.0.7")).message


def test_a_4xx_keeps_its_message():
    """The negative control: the app's own request errors are for the client and say what to fix."""
    assert api_error(RequestError("max_tokens is 9999; the limit is 2048")).message == \
        "max_tokens is 9999; the limit is 2048"
