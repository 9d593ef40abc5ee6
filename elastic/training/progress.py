"""Progress reports from workers to the driver's console and event log."""

from __future__ import annotations

import time

from elastic.worker import runtime

_MIN_INTERVAL_S = 0.5
_last = [0.0]


def report_progress(step: int | None = None, samples: int | None = None,
                    **metrics: float) -> None:
    """Tell elasticrun how far training got; cheap enough to call every step.

    Only rank 0's reports are shown. Calls closer than 0.5 s apart are
    dropped, so the control store sees at most two writes a second.
    """
    w = runtime.worker()
    if w is None or w.membership is None or w.membership.rank != 0:
        return
    now = time.monotonic()
    if now - _last[0] < _MIN_INTERVAL_S:
        return
    _last[0] = now
    values = {k: v for k, v in dict(metrics, step=step, samples=samples).items() if v is not None}
    w.report_progress({k: (float(v) if not isinstance(v, int) else v) for k, v in values.items()})
