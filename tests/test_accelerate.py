"""HF Accelerate (the real package) inside @elastic.run, through a crash and a scale-up:
examples/train_accelerate.py rebuilds its Accelerator and prepared objects each round."""

import pytest
from support.jobs import REPO, Job, assert_exactly_once

pytest.importorskip("accelerate")
EXAMPLE = REPO / "examples" / "train_accelerate.py"


def test_accelerate_across_a_crash_and_a_scale_up(tmp_path):
    out = tmp_path / "out"
    job = Job(tmp_path, ["-np", "3", "--min-np", "2", "--max-np", "3"],
              hosts=["localhost:2", "127.0.0.1:1"], script=EXAMPLE,
              script_args=["--out", out, "--kill-at", "3", "--hold", "6"]).start()
    job.wait_for(lambda: any(r["step"] >= 6 and r["size"] == 2 for r in job.steps()),
                 "step 6 on 2 workers after the crash")
    job.set_hosts(["localhost:2", "127.0.0.2:1"])          # scale up at step 6's commit
    assert job.finish() == 0, job.output()[-4000:]
    assert (out / "killed").exists()
    steps = job.steps()
    assert {r["size"] for r in steps} == {2, 3}
    assert any(r["size"] == 3 and r["step"] > 6 for r in steps)
    # Accelerate saw each round's world: its rank and size, its DDP, its device.
    for r in steps:
        assert 0 <= r["rank"] < r["size"] and r["ddp"] == "DistributedDataParallel", r
        assert r["device"].startswith("cpu"), r
    finals = job.finals()
    assert len(finals) == 3
    for f in finals[1:]:
        assert f["params"] == finals[0]["params"] and f["history"] == finals[0]["history"]
    assert_exactly_once(finals[0]["history"], epochs=2, samples=96)
