"""The Ray executor's work directory on a node (elastic/ray/workdir.py): 0700 all the
way down, and a fn.pkl it did not write is refused, never unpickled."""

import os
import stat

import pytest

from elastic.ray.workdir import UnsafeWorkdir, place_payload, private_tree


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_every_directory_is_made_0700_all_the_way_down(tmp_path):
    work = tmp_path / "elastic-ray-x"
    os.umask(0o022)
    private_tree(str(work), "results/errors", "results/round.3")
    for d in (work, work / "results", work / "results" / "errors", work / "results" / "round.3"):
        assert _mode(d) == 0o700, d


def test_an_existing_directory_of_ours_is_tightened(tmp_path):
    work = tmp_path / "w"
    (work / "results").mkdir(parents=True, mode=0o777)
    os.chmod(work / "results", 0o777)
    private_tree(str(work), "results/errors")
    assert _mode(work / "results") == 0o700


def test_a_link_where_a_directory_belongs_is_refused(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", work / "results")
    with pytest.raises(UnsafeWorkdir, match="not a directory of this user"):
        private_tree(str(work), "results/errors")


def test_the_payload_is_written_once_and_reused_only_when_it_is_ours(tmp_path):
    work = str(tmp_path)
    path = place_payload(work, b"job payload")
    assert _mode(path) == 0o600 and open(path, "rb").read() == b"job payload"
    assert place_payload(work, b"job payload") == path         # another agent on this node


def test_a_fn_pkl_someone_else_wrote_is_refused(tmp_path):
    planted = tmp_path / "fn.pkl"
    planted.write_bytes(b"cos\nsystem\n(S'touch /tmp/owned'\ntR.")
    os.chmod(planted, 0o600)
    with pytest.raises(UnsafeWorkdir, match="not written by this job"):
        place_payload(str(tmp_path), b"job payload")
    os.chmod(planted, 0o644)
    with pytest.raises(UnsafeWorkdir):
        place_payload(str(tmp_path), planted.read_bytes())       # the same bytes, but readable


def test_a_fn_pkl_that_is_a_link_is_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"job payload")
    os.symlink(target, tmp_path / "fn.pkl")
    with pytest.raises(UnsafeWorkdir):
        place_payload(str(tmp_path), b"job payload")
