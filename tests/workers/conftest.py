"""Jobs run under unprivileged uids when the tests run as root: ``tmp_path`` is a directory they can reach."""

from tests.jobdirs import tmp_path  # noqa: F401 - the fixture
