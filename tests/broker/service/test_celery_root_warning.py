"""``fedbroker serve worker`` as root (the README's one-machine recipe) prints no Celery superuser warning: the
worker accepts JSON only and runs the broker's own tasks (:func:`broker.service.celery_app.quiet_root_warning`)."""

from __future__ import annotations

import os
import warnings

import pytest


@pytest.mark.skipif(os.geteuid() != 0, reason="Celery warns only when the worker runs as root")
def test_a_root_worker_of_json_only_prints_no_superuser_warning():
    from celery.exceptions import SecurityWarning
    from celery.platforms import check_privileges

    from broker.service.celery_app import make_celery, quiet_root_warning
    from broker.service.settings import BrokerSettings

    app = make_celery(BrokerSettings())
    assert app.conf.accept_content == ["json"]  # why the warning does not apply
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check_privileges(app.conf.accept_content)
    assert [w.category for w in seen] == [SecurityWarning]  # what the README's recipe printed as root
    assert str(seen[0].message).startswith("You're running the worker with superuser privileges: this is\n"
                                           "absolutely not recommended!")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert quiet_root_warning(app) is True
        check_privileges(app.conf.accept_content)
        warnings.warn("another warning", SecurityWarning)  # only that one warning is silenced
    assert [str(w.message) for w in seen] == ["another warning"]

    pickling = make_celery(BrokerSettings())
    pickling.conf.accept_content = ["json", "pickle"]
    with warnings.catch_warnings():
        assert quiet_root_warning(pickling) is False  # a worker that unpickles keeps Celery's warning/refusal
