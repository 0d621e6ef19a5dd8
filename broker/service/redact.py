"""Keeping secrets out of logs: URLs without their passwords, and a logging filter that masks known secrets.

* :func:`mask_url` — ``postgresql+psycopg://broker:***@db/fedbroker``, ``redis://:***@redis:6379/0``; use it
  wherever a database, Redis or report URL is printed or logged.
* :func:`settings_secrets` — the secret strings of a :class:`broker.service.settings.BrokerSettings` (the passwords of
  ``database_url`` and ``redis_url``, ``admin_token``).
* :func:`is_secret_name` — the one rule for a field or parameter name whose value is a secret (``api_key``,
  ``admin_token``, ``password``, ``client_secret``, ``jwt``, ``credentials``); :func:`hide_secret_values` and
  :func:`mask_userinfo` keep such values and ``user:password@`` out of an error line (``<hidden>``, ``***``).
* :class:`SecretFilter` — a :class:`logging.Filter` that replaces each of those strings with ``***`` in every
  record it sees (message, arguments and exception text); :func:`install_secret_filter` puts one on every
  handler of the root logger, so records from any library (Celery, kombu, SQLAlchemy, uvicorn) pass it.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["MASK", "HIDDEN", "is_secret_name", "hide_secret_values", "mask_userinfo", "mask_url", "mask_text", "settings_secrets", "SecretFilter", "install_secret_filter"]

#: what a secret is replaced by
MASK = "***"
#: what a secret field's value is shown as in an error line
HIDDEN = "<hidden>"
#: a name whose value is a secret: it holds one of these words (case-insensitive); names of where a secret is
#: kept (``jwt_file``, ``secrets_file``, ``api_key_env``) are not secrets themselves
_SECRET_NAME = re.compile(r"key|token|pass|secret|jwt|credential", re.IGNORECASE)
_SECRET_HOLDER = re.compile(r"_(file|path|env)$", re.IGNORECASE)
#: ``scheme://user:password@`` in free text, also in a URL too broken for urlsplit (``ftp://u:p@[::1``)
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:'\"]*):[^\s/@'\"]*@")
#: secrets shorter than this are not searched for in log text (masking "a" would mangle every line)
_MIN_SECRET_LEN = 4


def is_secret_name(name: object) -> bool:
    """Whether a field, key or query parameter called ``name`` holds a secret (the one rule): its name contains
    key, token, pass(word), secret, jwt or credential, and it does not end in ``_file``/``_path``/``_env``
    (those name where a secret is kept). A non-string name (a list index) is never secret."""
    return isinstance(name, str) and bool(_SECRET_NAME.search(name)) and not _SECRET_HOLDER.search(name)


def hide_secret_values(value: object, name: object = None) -> object:
    """``value`` for an error line: :data:`HIDDEN` when ``name`` is a secret's name, else ``value`` with the
    values of secret-named keys replaced by :data:`HIDDEN` in every nested mapping or list; a string has its
    URL passwords masked (:func:`mask_userinfo`)."""
    if is_secret_name(name):
        return HIDDEN
    if isinstance(value, dict):
        return {k: hide_secret_values(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(hide_secret_values(v) for v in value)
    if isinstance(value, str):
        return mask_userinfo(value)
    return value


def mask_userinfo(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it replaced by ``***``; unlike
    :func:`mask_url` it works on a whole message and on URLs too broken to parse."""
    return _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)


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
        if any(is_secret_name(k) for k, _ in pairs):
            query = urlencode([(k, MASK if is_secret_name(k) else v) for k, v in pairs], safe="*/:")
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
        out += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if is_secret_name(k) and v]
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
