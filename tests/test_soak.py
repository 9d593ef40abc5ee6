"""The short, seeded version of the soak (``make soak`` runs 200 changes): every kind of
fault once or more against one real job, and the soak's end-of-run checks."""

import pytest
from support.soak import Soak, table

pytestmark = pytest.mark.slow


def test_short_soak_keeps_every_invariant(tmp_path):
    summary = Soak(tmp_path, changes=8, seed=3).run()
    print(table(summary))
    assert summary["changes"] >= 8
    assert summary["counts"]["driver SIGTERM + rerun"] == 1
