"""Checkpoint integrity helpers: incomplete tags are ignored, interrupted swaps are repaired."""

import json

from longsft.train.common.io import atomic_write_json, recover_dir, replace_dir
from longsft.train.training.checkpoint import MANIFEST, latest_resume


def test_latest_resume_ignores_tags_without_manifest(tmp_path):
    ckpt = tmp_path / "stage" / "ckpt"
    for step, complete in ((2, True), (4, True), (6, False)):  # step 6: a save cut short by a crash
        (ckpt / f"step_{step:07d}").mkdir(parents=True)
        if complete:
            atomic_write_json(ckpt / f"step_{step:07d}" / MANIFEST, {"step": step})
    assert latest_resume(tmp_path / "stage").name == "step_0000004"
    assert latest_resume(tmp_path / "nothing") is None


def test_replace_dir_and_recovery(tmp_path):
    final, tmp = tmp_path / "best", tmp_path / "best.tmp"
    final.mkdir()
    (final / "w").write_text("old")
    tmp.mkdir()
    (tmp / "w").write_text("new")
    replace_dir(tmp, final)
    assert (final / "w").read_text() == "new" and not tmp.exists()
    assert not (tmp_path / "best.old").exists()
    # a crash between the two renames leaves only best.old: recovery brings it back
    final.rename(tmp_path / "best.old")
    recover_dir(final)
    assert (final / "w").read_text() == "new"


def test_atomic_write_leaves_no_partial_file(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_json(path, {"a": 1})
    atomic_write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_damage_names_what_is_wrong_with_a_checkpoint(tmp_path):
    from longsft.train.training.checkpoint import complete_tags, damage

    tag = tmp_path / "ckpt" / "step_0000004"
    tag.mkdir(parents=True)
    assert damage(tag) == "no manifest: the save was cut short"
    (tag / "optim.pt").write_bytes(b"x" * 10)
    atomic_write_json(tag / MANIFEST, {"step": 4, "files": {"optim.pt": 10, "rng.pt": 3}})
    assert damage(tag) == "rng.pt is missing"
    (tag / "rng.pt").write_bytes(b"abc")
    assert damage(tag) is None and complete_tags(tmp_path / "ckpt") == [tag]
    (tag / "optim.pt").write_bytes(b"x" * 4)
    assert damage(tag) == "optim.pt has 4 bytes, the manifest says 10"
    assert complete_tags(tmp_path / "ckpt") == []
    (tag / MANIFEST).write_text("{trunc")
    assert damage(tag) == "unreadable manifest"
