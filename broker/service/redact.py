"""Keeping secrets out of logs: URLs without their passwords, and a logging filter that masks known secrets.

* :func:`mask_url` — ``postgresql+psycopg://broker:***@db/fedbroker``, ``redis://:***@redis:6379/0``; use it
  wherever a database, Redis or report URL is printed or logged.
* :func:`settings_secrets` — the secret strings of a :class:`broker.service.settings.BrokerSettings` (the passwords of
  ``database_url`` and ``redis_url``, ``admin_token``).
* :class:`SecretFilter` — a :class:`logging.Filter` that replaces each of those strings with ``***`` in every
  record it sees (message, arguments and exception text); :func:`install_secret_filter` puts one on every
  handler of the root logger, so records from any library (Celery, kombu, SQLAlchemy, uvicorn) pass it.
"""

from __future__ import annotations

import logging
from typing import Iterable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["MASK", "mask_url", "mask_text", "settings_secrets", "SecretFilter", "install_secret_filter"]

#: what a secret is replaced by
MASK = "***"
#: query parameters whose values are secrets (``?password=...`` in a libpq or Redis URL)
_SECRET_PARAMS = frozenset({"password", "pass", "passwd", "token", "secret", "sslpassword"})
#: secrets shorter than this are not searched for in log text (masking "a" would mangle every line)
_MIN_SECRET_LEN = 4


def mask_url(url: str | None) -> str:
    """``url`` with its password (``user:PASSWORD@``) and secret query parameters replaced by ``***``.

    Works for any ``scheme://user:password@host/...`` URL (SQLAlchemy, Redis, HTTP). A URL that cannot
    be parsed is returned as ``"<url hidden>"`` rather than risk printing it; ``None`` gives ``""``.
    """
    if not url:
        return ""
    try:
        parts = urlsplit(url)
        netloc, query = parts.netloc, parts.query
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            user, sep, _ = userinfo.partition(":")
            netloc = f"{user}:{MASK}@{host}" if sep else f"{userinfo}@{host}"
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_PARAMS for k, _ in pairs):
            query = urlencode([(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in pairs], safe="*/:")
        if (netloc, query) == (parts.netloc, parts.query):
            return url  # nothing secret (urlunsplit would also drop the empty host of sqlite:////abs/path)
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<url hidden>"


def _url_secrets(url: str | None) -> list[str]:
    """The password of ``url`` (raw and percent-decoded) and its secret query values."""
    if not url:
        return []
    out: list[str] = []
    try:
        parts = urlsplit(url)
        if "@" in parts.netloc:
            userinfo = parts.netloc.rsplit("@", 1)[0]
            user, sep, pw = userinfo.partition(":")
            if sep and pw:
                out += [pw, unquote(pw)]
        out += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in _SECRET_PARAMS and v]
    except ValueError:
        pass
    return out


def settings_secrets(settings) -> list[str]:
    """The secret strings of ``settings``: passwords in ``database_url`` and ``redis_url`` (and in
    ``cloud.report_url``), ``admin_token``; longest first, without duplicates or strings under 4 characters."""
    found: list[str] = []
    found += _url_secrets(getattr(settings, "database_url", None))
    found += _url_secrets(getattr(settings, "redis_url", None))
    cloud = getattr(settings, "cloud", None)
    found += _url_secrets(getattr(cloud, "report_url", None))
    if getattr(settings, "admin_token", None):
        found.append(settings.admin_token)
    return sorted({s for s in found if len(s) >= _MIN_SECRET_LEN}, key=len, reverse=True)


def mask_text(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each of ``secrets`` replaced by ``***``."""
    for s in secrets:
        if s and s in text:
            text = text.replace(s, MASK)
    return text


class SecretFilter(logging.Filter):
    """Masks ``secrets`` in every record: the formatted message (arguments merged in) and the exception
    text. Never drops a record."""

    def __init__(self, secrets: Iterable[str]):
        super().__init__()
        self.secrets = sorted({s for s in secrets if s and len(s) >= _MIN_SECRET_LEN}, key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: leave it to the handler to report
            return True
        masked = mask_text(message, self.secrets)
        if masked != message or record.args:
            record.msg, record.args = masked, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_text(record.exc_text, self.secrets)
        return True


def install_secret_filter(settings, logger: logging.Logger | None = None) -> SecretFilter:
    """Put a :class:`SecretFilter` for :func:`settings_secrets` on every handler of ``logger`` (default: the
    root logger) that has none yet; returns the filter. Call it after the handlers are set up."""
    logger = logger or logging.getLogger()
    flt = SecretFilter(settings_secrets(settings))
    for h in logger.handlers:
        for old in [f for f in h.filters if isinstance(f, SecretFilter)]:
            h.removeFilter(old)
        h.addFilter(flt)
    return flt
