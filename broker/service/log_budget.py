"""The per-team log byte budget (``quotas.log_bytes``; issue #20 item 3, finding #4).

A job's output once filled the broker's database: 16 MiB per attempt kept for ``retention_days`` and no team
budget (24 jobs grew the store by 387 MiB in 30 s). Two bounds now hold in the store:

* **per attempt rank**: ``log_max_bytes`` on every chunk a node ships (:meth:`JobStore.append_log`), head and
  tail kept, as the node's shim does;
* **per team**: each reconciler pass (:func:`enforce_log_budgets`) sums every team's stored log bytes
  (``job_logs.bytes``, UTF-8) and, for a team over its ``quotas.log_bytes``, trims the team's logs **oldest
  first** (by their first stored chunk) until it is within it:

  1. to their head and tail, ``log_trim_keep_bytes`` each (whole chunks), with one
     ``[fedbroker: ... N bytes dropped ...]`` chunk between (:func:`broker.service.store.logs.trim_log`);
  2. if every log of the team is so trimmed and it is still over, oldest first to that one marker chunk.

  A team within its budget is never touched; another team's logs never pay for it. At most ``max_logs`` logs
  (100) are trimmed per pass, in transactions of up to 100 logs, the rest in the next passes.
"""

from __future__ import annotations

from broker.log_marker import MARKER_MAX_BYTES
from broker.service.store import logs as logs_repo

__all__ = ["enforce_log_budgets"]


def enforce_log_budgets(store, quotas, keep_bytes: int, max_logs: int = 100) -> dict[str, int]:
    """Trim the logs of every team over its ``quotas.for_team(team).log_bytes`` (see the module docstring).

    Args:
        store: the :class:`broker.service.store.core.JobStore`.
        quotas: :class:`broker.service.settings.QuotaSettings`.
        keep_bytes: bytes of head and of tail a trimmed log keeps (``settings.log_trim_keep_bytes``).
        max_logs: most logs trimmed in this call.

    Returns:
        ``{"teams_over": teams found over budget, "logs_trimmed": logs changed, "bytes_freed": bytes}``.
    """
    with store.session() as s:
        usage = logs_repo.team_log_bytes(s)
    out = {"teams_over": 0, "logs_trimmed": 0, "bytes_freed": 0}
    left = max_logs
    for team in sorted(usage):
        used, budget = usage[team], quotas.for_team(team).log_bytes
        if not budget or used <= budget:
            continue
        out["teams_over"] += 1
        for head, tail, more_than in ((keep_bytes, keep_bytes, 2 * keep_bytes + MARKER_MAX_BYTES),
                                      (0, 0, MARKER_MAX_BYTES)):
            while used > budget and left > 0:
                with store.session() as s:
                    batch = logs_repo.team_logs_oldest_first(s, team, more_than, min(left, 100))
                if not batch:
                    break
                freed_any = False
                with store.session() as s:  # one transaction per batch (15 ms a log one by one on 2 loaded cores)
                    for job_id, attempt, rank, _ in batch:
                        if used <= budget or left <= 0:
                            break
                        freed = logs_repo.trim_log(s, job_id, attempt, rank, head, tail)
                        left -= 1
                        if freed:
                            freed_any = True
                            used -= freed
                            out["logs_trimmed"] += 1
                            out["bytes_freed"] += freed
                if not freed_any:
                    break  # nothing more this phase can free (whole chunks bigger than the keep)
            if used <= budget or left <= 0:
                break
    return out
