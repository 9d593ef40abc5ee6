"""examples/recipes.py (AMP with a committed GradScaler, gradient clipping, torch.compile,
a DataLoader with persistent workers, an LR scheduler with LRScaler) through a scale-up
and a graceful removal, in one job."""

from support.jobs import REPO, Job, assert_exactly_once

RECIPES = REPO / "examples" / "recipes.py"


def test_recipes_across_a_scale_up_and_a_removal(tmp_path):
    out = tmp_path / "out"
    job = Job(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3"],
              hosts=["localhost:2"], script=RECIPES,
              script_args=["--compile-backend", "counting", "--out", out, "--hold", "3,7"])
    job.start()
    job.wait_step(3)
    job.set_hosts(["localhost:2", "127.0.0.1:1"])          # 2 -> 3 at step 3's commit
    job.wait_step(4, size=3)
    job.wait_step(7)
    job.set_hosts(["localhost:2"])                          # 3 -> 2 at step 7's commit
    assert job.finish() == 0, job.output()[-4000:]
    steps = job.steps()
    by_step = {r["step"]: r["size"] for r in steps}
    sizes = [by_step[s] for s in sorted(by_step)]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [2, 3, 2]
    finals = job.finals()
    assert len(finals) == 2
    for key in ("params", "scaler", "schedule", "history", "step"):
        assert finals[0][key] == finals[1][key], key          # ranks bitwise equal
    # 4: every sample once per epoch across both changes (DataLoader workers included).
    assert_exactly_once(finals[0]["history"], epochs=2, samples=96)
    # 1: the scaler's state was committed and synced: it grew every 2 steps on every rank,
    # the newcomer's included (a fresh scaler would start again at 2**8).
    assert finals[0]["scaler"]["scale"] > 2.0 ** 8
    # 3: compiled once per input shape, not once per round.
    for r in steps:
        assert 1 <= r["compiles"] <= r["shapes"], r
    # 5: the scheduler's lr is the unscaled one; the step uses it times size / base_size.
    for r in steps:
        assert r["lr"] == 0.1 * 0.5 ** (r["step"] // 5), r
        assert abs(r["scaled_lr"] - r["lr"] * r["size"] / 2) < 1e-12, r
