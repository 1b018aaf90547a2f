"""The completeness and verification rules of supervisor/runfiles/checkpoint_scan.py, per layout."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.runfiles import checkpoint_scan
from supervisor.runfiles.checkpoint_scan import LAYOUTS, Verdict, inspect, pick, scan


def newest(root: Path, layout: str | None = None) -> Verdict | None:
    return pick(root, layout)[0]


def steps(verdicts: list[Verdict]) -> list[tuple[int, bool]]:
    return [(v.step, v.ok) for v in verdicts]


# Fixture trees, one maker per layout, shaped like reference/tool-outputs/checkpoint_layouts.txt.

def make(root: Path, step: int, *, name: str | None = None, metadata: bool = True, meta_step: int | None = None,
         shards: tuple[int, ...] = (10, 10)) -> Path:
    """The project's own trainer (tsup)."""
    d = root / (name or f"step_{step:08d}")
    d.mkdir(parents=True)
    if metadata:
        (d / ".metadata").write_bytes(b"x" * 8)
    (d / "trainer_meta.json").write_text(json.dumps({"step": meta_step if meta_step is not None else step}))
    for i, size in enumerate(shards):
        (d / f"__{i}_0.distcp").write_bytes(b"y" * size)
    return d


def make_dcp(root: Path, name: str, *, metadata: str = "full", shards: tuple[int, ...] = (10, 10)) -> Path:
    """A torch.distributed.checkpoint directory; metadata is "full", "empty", "tmp" or "none"."""
    d = root / name
    d.mkdir(parents=True)
    for i, size in enumerate(shards):
        (d / f"__{i}_0.distcp").write_bytes(b"y" * size)
    if metadata == "full":
        (d / ".metadata").write_bytes(b"pickled Metadata")
    elif metadata == "empty":
        (d / ".metadata").touch()
    elif metadata == "tmp":
        (d / ".metadata.tmp").write_bytes(b"pickled Meta")
    return d


def make_nxd_tag(d: Path, *, done: bool = True, model_size: int = 10) -> Path:
    """An NxD save (nxd.save_checkpoint) into directory ``d``: checkpoint first, done last."""
    (d / "model").mkdir(parents=True)
    (d / "checkpoint").write_text("1")
    (d / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_bytes(b"m" * model_size)
    (d / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors").mkdir()
    (d / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors" / "tensor_0.pt").write_bytes(b"t" * 4)
    (d / "optim").mkdir()
    (d / "optim" / "dp_rank_01_tp_rank_00_pp_rank_00.pt").write_bytes(b"o" * 10)
    (d / "user_content.pt").write_bytes(b"u" * 10)
    if done:
        (d / "done").write_text("1")
    return d


def make_nxd(root: Path, step: int, *, done: bool = True, model_size: int = 10) -> Path:
    return make_nxd_tag(root / f"step_{step}", done=done, model_size=model_size)


def nemo_name(step: int, *, last: bool = False) -> str:
    return f"hf_llama3_8B--step={step}-consumed_samples={step * 32}.0{'-last' if last else ''}.ckpt"


def make_nemo(root: Path, step: int, *, last: bool = False, done: bool = True, unfinished: bool = False,
              model_size: int = 10) -> Path:
    d = make_nxd_tag(root / nemo_name(step, last=last), done=done, model_size=model_size)
    if unfinished:
        (root / (d.name.removesuffix(".ckpt") + "-unfinished")).touch()
    return d


def make_hf(root: Path, step: int, *, state: str | None = "default", weights_size: int = 10) -> Path:
    """An HF Trainer checkpoint; state is trainer_state.json's text, None for none."""
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w" * weights_size)
    (d / "optimizer.pt").write_bytes(b"o" * 10)
    (d / "rng_state.pth").write_bytes(b"r" * 10)
    if state is not None:
        (d / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "log_history": []}) if state == "default" else state)
    return d


def make_megatron(root: Path, iteration: int | str, *, fmt: str = "legacy", size: int = 10) -> Path:
    """A Megatron-LM iteration directory (the tracker is written separately, by track())."""
    d = root / (f"iter_{iteration:07d}" if isinstance(iteration, int) else iteration)
    d.mkdir(parents=True)
    if fmt == "legacy":
        for rank in ("mp_rank_00", "mp_rank_01"):
            (d / rank).mkdir()
            (d / rank / "model_optim_rng.pt").write_bytes(b"p" * size)
    elif fmt == "torch_dist":
        (d / "__0_0.distcp").write_bytes(b"y" * size)
        (d / "common.pt").write_bytes(b"c" * 10)
        (d / ".metadata").write_bytes(b"pickled Metadata")
    return d


def track(root: Path, text: str) -> None:
    (root / "latest_checkpointed_iteration.txt").write_text(text)


# tsup: the project's own trainer.

def test_newest_complete_wins(tmp_path: Path) -> None:
    make(tmp_path, 20)
    make(tmp_path, 40)
    assert newest(tmp_path).step == 40  # type: ignore[union-attr]


def test_save_in_progress_is_never_complete(tmp_path: Path) -> None:
    make(tmp_path, 20)
    make(tmp_path, 40, name=".tmp-step_00000040")
    make(tmp_path, 60, metadata=False)
    ref = newest(tmp_path)
    assert ref is not None and ref.step == 20
    [v60, v20] = scan(tmp_path)
    assert not v60.ok and "no .metadata" in v60.why and v20.ok


def test_newest_failing_verification_falls_back_to_the_previous(tmp_path: Path) -> None:
    make(tmp_path, 20)
    make(tmp_path, 40, shards=(10, 0))  # a truncated shard
    make(tmp_path, 60, meta_step=59)
    verdicts = scan(tmp_path)
    assert [(v.step, v.ok) for v in verdicts] == [(60, False), (40, False), (20, True)]
    assert "empty shard" in verdicts[1].why and "names step 59" in verdicts[0].why
    best, rejected = pick(tmp_path)
    assert best is not None and best.step == 20 and [v.step for v in rejected] == [60, 40]


def test_missing_directory_and_foreign_files_are_ignored(tmp_path: Path) -> None:
    assert newest(tmp_path / "absent") is None
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "step_12").mkdir()  # not 8 digits: not this layout
    assert scan(tmp_path) == []


def test_a_tsup_checkpoint_whose_files_differ_in_size_from_its_manifest_is_passed_over(tmp_path: Path) -> None:
    good = make(tmp_path, 20)
    bad = make(tmp_path, 40)
    for d in (good, bad):
        files = {p.name: {"size": p.stat().st_size, "sha256": "0" * 64}
                 for p in d.iterdir() if p.name != "trainer_meta.json"}
        (d / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))
    assert inspect(bad) is not None and inspect(bad).ok  # type: ignore[union-attr]
    os.truncate(bad / "__1_0.distcp", 4)
    assert inspect(bad) == Verdict(step=40, path=bad, ok=False, layout="tsup",
                                   why="__1_0.distcp is 4 bytes, its manifest says 10")
    (bad / "__1_0.distcp").unlink()
    assert "__1_0.distcp is missing" in inspect(bad).why  # type: ignore[union-attr]
    assert newest(tmp_path) == inspect(good), "the one before it is chosen"
    (good / "manifest.json").write_text("{not json")
    assert "manifest.json unreadable" in inspect(good).why  # type: ignore[union-attr]


def test_tsup_verdicts_name_their_layout(tmp_path: Path) -> None:
    d = make(tmp_path, 20)
    assert scan(tmp_path) == [Verdict(step=20, path=d, ok=True, why="", layout="tsup")]


# dcp: a generic torch.distributed.checkpoint directory.

def test_dcp_is_complete_when_a_non_empty_metadata_exists(tmp_path: Path) -> None:
    done = make_dcp(tmp_path, "llama_v3-50steps")
    make_dcp(tmp_path, "llama_v3-100steps", metadata="none", shards=(10,))  # ranks still writing
    make_dcp(tmp_path, "llama_v3-150steps", metadata="empty")
    best, rejected = pick(tmp_path)
    assert best == Verdict(step=50, path=done, ok=True, why="", layout="dcp")
    assert [(v.step, v.why) for v in rejected] == [
        (150, "empty .metadata (the save did not finish)"),
        (100, "no .metadata (the save did not finish)"),
    ]


def test_dcp_with_only_metadata_tmp_is_partial(tmp_path: Path) -> None:
    make_dcp(tmp_path, "llama_v3-50steps")
    make_dcp(tmp_path, "llama_v3-100steps", metadata="tmp")  # killed during finish()
    [v100, v50] = scan(tmp_path)
    assert (v100.step, v100.ok, v100.layout) == (100, False, "dcp") and ".metadata.tmp" in v100.why
    assert v50.ok and newest(tmp_path) == v50


def test_dcp_with_an_empty_shard_fails_verification(tmp_path: Path) -> None:
    make_dcp(tmp_path, "llama_v3-50steps")
    make_dcp(tmp_path, "llama_v3-100steps", shards=(10, 0, 10))
    best, [bad] = pick(tmp_path)
    assert best is not None and best.step == 50
    assert bad.step == 100 and bad.why == "empty shard file(s): __1_0.distcp"


def test_dcp_generic_names_are_claimed_only_with_dcp_files(tmp_path: Path) -> None:
    make_dcp(tmp_path, "step-30")  # torchtitan's name
    (tmp_path / "step-90").mkdir()  # an empty directory is nobody's checkpoint
    make_dcp(tmp_path, "llama3")  # DCP files, but no step in the name (pretrained weights)
    (tmp_path / "run-70steps").mkdir()
    assert [(v.step, v.layout) for v in scan(tmp_path)] == [(30, "dcp")]


# nxd: neuronx-distributed step_<N>/.

def test_nxd_is_complete_only_with_done(tmp_path: Path) -> None:
    five = make_nxd(tmp_path, 5)
    make_nxd(tmp_path, 10, done=False)  # `checkpoint` alone: the save did not finish
    best, [partial] = pick(tmp_path)
    assert best == Verdict(step=5, path=five, ok=True, why="", layout="nxd")
    assert (partial.step, partial.layout, partial.why) == (10, "nxd", "no done marker (the save did not finish)")


def test_nxd_legacy_newest_file_is_not_a_completeness_marker(tmp_path: Path) -> None:
    make_nxd(tmp_path, 5)
    make_nxd(tmp_path, 10, done=False)
    (tmp_path / "newest").write_text("step_5\nstep_10\n")  # written before the data
    ref = newest(tmp_path)
    assert ref is not None and ref.path == tmp_path / "step_5"


def test_nxd_directory_without_markers_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "step_7" / "model").mkdir(parents=True)
    (tmp_path / "pretrained_weight" / "model").mkdir(parents=True)
    assert scan(tmp_path) == []


def test_nxd_with_an_empty_model_file_fails_verification(tmp_path: Path) -> None:
    make_nxd(tmp_path, 5)
    make_nxd(tmp_path, 10, model_size=0)
    best, [bad] = pick(tmp_path)
    assert best is not None and best.step == 5
    assert bad.why == "empty file(s): model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


# nemo: NxD Training / NeMo exp_manager.

def test_nemo_step_comes_from_the_name_and_done_is_required(tmp_path: Path) -> None:
    five = make_nemo(tmp_path, 5)
    make_nemo(tmp_path, 10, last=True, done=False)
    best, [partial] = pick(tmp_path)
    assert best == Verdict(step=5, path=five, ok=True, why="", layout="nemo")
    assert partial.step == 10 and partial.path.name.endswith("-last.ckpt") and "no done" in partial.why


def test_nemo_unfinished_marker_overrides_done(tmp_path: Path) -> None:
    make_nemo(tmp_path, 5)
    make_nemo(tmp_path, 15, unfinished=True)
    make_nemo(tmp_path, 20, last=True, unfinished=True)  # the marker of a -last save ends -last-unfinished
    best, rejected = pick(tmp_path)
    assert best is not None and best.step == 5
    assert [(v.step, v.why) for v in rejected] == [
        (20, "hf_llama3_8B--step=20-consumed_samples=640.0-last-unfinished marker present "
             "(the save is in progress or was cut short)"),
        (15, "hf_llama3_8B--step=15-consumed_samples=480.0-unfinished marker present "
             "(the save is in progress or was cut short)"),
    ]


def test_nemo_marker_drops_the_ema_suffix(tmp_path: Path) -> None:
    make_nxd_tag(tmp_path / "m--step=7-EMA.ckpt")
    assert newest(tmp_path) is not None
    (tmp_path / "m--step=7-unfinished").touch()
    [v] = scan(tmp_path)
    assert not v.ok and v.step == 7 and "m--step=7-unfinished marker" in v.why


def test_nemo_last_and_plain_saves_of_one_step(tmp_path: Path) -> None:
    paths = {make_nemo(tmp_path, 10), make_nemo(tmp_path, 10, last=True)}
    make_nemo(tmp_path, 5)
    ref = newest(tmp_path)
    assert ref is not None and ref.step == 10 and ref.path in paths


def test_nemo_lone_unfinished_marker_and_plain_ckpt_files_are_not_nemo(tmp_path: Path) -> None:
    (tmp_path / "hf_llama3_8B--step=15-consumed_samples=480.0-unfinished").touch()
    (tmp_path / "plain--step=20.ckpt").write_bytes(b"a PTL file, not an NxD tag")
    assert scan(tmp_path, "nemo") == []
    [torn] = scan(tmp_path)  # a Lightning checkpoint file, cut short
    assert (torn.layout, torn.step, torn.ok) == ("lightning", 20, False) and "no zip end record" in torn.why


# lightning: ModelCheckpoint's files, "epoch=0-step=40.ckpt", written by torch.save (a zip).

def make_lightning(root: Path, step: int, *, torn: bool = False) -> Path:
    import zipfile

    path = root / f"epoch=0-step={step}.ckpt"
    root.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"x" * 1000)
    if torn:
        os.truncate(path, path.stat().st_size // 2)
    return path


def test_a_lightning_checkpoint_file_is_complete_with_its_zip_end_record(tmp_path: Path) -> None:
    whole = make_lightning(tmp_path, 40)
    make_lightning(tmp_path, 50, torn=True)
    best, [torn] = pick(tmp_path, "lightning")
    assert best == Verdict(step=40, path=whole, ok=True, why="", layout="lightning")
    assert torn.step == 50 and "the save was cut short" in torn.why


# hf: HF Trainer checkpoint-<N>/.

def test_hf_is_complete_when_trainer_state_json_exists(tmp_path: Path) -> None:
    d = make_hf(tmp_path, 500)
    make_hf(tmp_path, 1000, state=None)
    best, [partial] = pick(tmp_path)
    assert best == Verdict(step=500, path=d, ok=True, why="", layout="hf")
    assert partial.step == 1000 and partial.why == "no trainer_state.json (the save did not finish)"


@pytest.mark.parametrize(("text", "why"), [
    ('{"global_step": 10', "trainer_state.json unreadable"),
    ("", "trainer_state.json unreadable"),
    ("[1, 2]", "trainer_state.json is not a JSON object"),
    ('{"global_step": 999}', "trainer_state.json names global_step 999"),
])
def test_hf_garbage_trainer_state_fails_and_falls_back(tmp_path: Path, text: str, why: str) -> None:
    make_hf(tmp_path, 500)
    make_hf(tmp_path, 1000, state=text)
    best, [bad] = pick(tmp_path)
    assert best is not None and best.step == 500
    assert bad.step == 1000 and not bad.ok and bad.why.startswith(why)


def test_hf_trainer_state_without_global_step_is_accepted(tmp_path: Path) -> None:
    make_hf(tmp_path, 500, state="{}")
    assert newest(tmp_path) is not None


# megatron: Megatron-LM iter_NNNNNNN/ and the tracker.

def test_megatron_iteration_newer_than_the_tracker_is_incomplete(tmp_path: Path) -> None:
    make_megatron(tmp_path, 1)
    two = make_megatron(tmp_path, 2)
    make_megatron(tmp_path, 3)  # all files written, but rank 0 never updated the tracker
    track(tmp_path, "2\n")
    best, [newer] = pick(tmp_path)
    assert best == Verdict(step=2, path=two, ok=True, why="", layout="megatron")
    assert newer.step == 3 and newer.path == tmp_path / "iter_0000003"
    assert newer.why == "newer than latest_checkpointed_iteration.txt (2): the save did not finish"
    assert steps(scan(tmp_path)) == [(3, False), (2, True), (1, True)]


def test_megatron_falls_back_when_the_tracked_iteration_is_broken(tmp_path: Path) -> None:
    make_megatron(tmp_path, 1)
    make_megatron(tmp_path, 2, size=0)
    make_megatron(tmp_path, 3, fmt="none")
    track(tmp_path, "3")
    best, [v3, v2] = pick(tmp_path)
    assert best is not None and best.path == tmp_path / "iter_0000001"
    assert "an empty iteration directory" in v3.why
    assert v2.why == "empty file(s): mp_rank_00/model_optim_rng.pt, mp_rank_01/model_optim_rng.pt"


def test_megatron_rank_directory_without_its_file_fails(tmp_path: Path) -> None:
    make_megatron(tmp_path, 1)
    d = make_megatron(tmp_path, 2)
    (d / "mp_rank_01" / "model_optim_rng.pt").unlink()
    track(tmp_path, "2")
    best, [bad] = pick(tmp_path)
    assert best is not None and best.step == 1 and bad.why == "no model_optim_rng.pt in mp_rank_01"


def test_megatron_torch_dist_format(tmp_path: Path) -> None:
    make_megatron(tmp_path, 1, fmt="torch_dist")
    make_megatron(tmp_path, 2, fmt="torch_dist", size=0)
    track(tmp_path, "2")
    best, [bad] = pick(tmp_path)
    assert best is not None and best.step == 1 and bad.why == "empty shard file(s): __0_0.distcp"


def test_megatron_release(tmp_path: Path) -> None:
    release = make_megatron(tmp_path, "release")
    make_megatron(tmp_path, 5)  # a save after the release that never got tracked
    track(tmp_path, "release")
    best, [newer] = pick(tmp_path)
    assert best == Verdict(step=0, path=release, ok=True, why="", layout="megatron")
    assert newer.step == 5 and "(release)" in newer.why


@pytest.mark.parametrize(("tracker", "why"), [
    (None, "no latest_checkpointed_iteration.txt (no save has finished)"),
    (b"", "latest_checkpointed_iteration.txt holds '', not an iteration"),
    (b"two\n", "latest_checkpointed_iteration.txt holds 'two', not an iteration"),
    (b"\xff\xfe", "latest_checkpointed_iteration.txt unreadable"),
])
def test_megatron_without_a_usable_tracker_nothing_is_complete(tmp_path: Path, tracker: bytes | None,
                                                                 why: str) -> None:
    make_megatron(tmp_path, 1)
    make_megatron(tmp_path, "release")
    if tracker is not None:
        (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(tracker)
    best, [v1] = pick(tmp_path)  # release/ is Megatron's only when the tracker says so
    assert best is None and v1.step == 1 and v1.why.startswith(why)


# All layouts together.

def test_mixed_layouts_in_one_directory(tmp_path: Path) -> None:
    make(tmp_path, 60, metadata=False)
    make_hf(tmp_path, 50)
    make_nemo(tmp_path, 45)
    make_nxd(tmp_path, 40)
    make_dcp(tmp_path, "llama_v3-30steps")
    make_megatron(tmp_path, 20)
    track(tmp_path, "20")
    assert [(v.step, v.layout, v.ok) for v in scan(tmp_path)] == [
        (60, "tsup", False), (50, "hf", True), (45, "nemo", True), (40, "nxd", True),
        (30, "dcp", True), (20, "megatron", True),
    ]
    best, [partial] = pick(tmp_path)
    assert best is not None and best.layout == "hf" and partial.layout == "tsup"
    for layout, step in [("tsup", None), ("hf", 50), ("nemo", 45), ("nxd", 40), ("dcp", 30), ("megatron", 20)]:
        ref = newest(tmp_path, layout)
        assert (ref.step if ref else None) == step, layout
        assert all(v.layout == layout for v in scan(tmp_path, layout))


def test_layout_filter_skips_the_others_claims(tmp_path: Path) -> None:
    # An NxD tag that happens to be named like tsup's: tsup claims it first when detecting,
    # but asking for nxd finds it.
    make_nxd_tag(tmp_path / "step_00000005")
    [auto] = scan(tmp_path)
    assert auto.layout == "tsup" and not auto.ok
    assert newest(tmp_path, "nxd") == Verdict(step=5, path=tmp_path / "step_00000005", ok=True, why="",
                                              layout="nxd")


def test_unknown_layout_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown checkpoint layout 'deepspeed'"):
        scan(tmp_path, "deepspeed")


def test_a_tie_on_step_prefers_the_ok_verdict(tmp_path: Path) -> None:
    make(tmp_path, 40, shards=(0,))
    hf = make_hf(tmp_path, 40)
    make_hf(tmp_path, 30)
    assert [(v.step, v.layout, v.ok) for v in scan(tmp_path)] == [(40, "hf", True), (40, "tsup", False), (30, "hf", True)]
    assert pick(tmp_path) == (Verdict(step=40, path=hf, ok=True, why="", layout="hf"), [])


def make_ok(root: Path, layout: str, step: int, *, broken: bool = False) -> Path:
    """A complete checkpoint of ``layout``; ``broken``: one that fails verification."""
    size = 0 if broken else 10
    if layout == "tsup":
        return make(root, step, shards=(10, size))
    if layout == "dcp":
        return make_dcp(root, f"llama_v3-{step}steps", shards=(size, 10))
    if layout == "nxd":
        return make_nxd(root, step, model_size=size)
    if layout == "nemo":
        return make_nemo(root, step, model_size=size)
    if layout == "hf":
        return make_hf(root, step, weights_size=size)
    if layout == "lightning":
        return make_lightning(root, step, torn=broken)
    track(root, str(step))
    return make_megatron(root, step, size=size)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_newest_failing_verification_falls_back_in_every_layout(tmp_path: Path, layout: str) -> None:
    older = make_ok(tmp_path, layout, 10)
    make_ok(tmp_path, layout, 20, broken=True)
    best, [bad] = pick(tmp_path)
    assert best == Verdict(step=10, path=older, ok=True, why="", layout=layout)
    assert (bad.step, bad.layout, bad.ok) == (20, layout, False)
    assert ("cut short" if layout == "lightning" else "empty") in bad.why


# Checkpoints that vanish while we look (the trainer deletes old ones).

@pytest.fixture
def vanishing(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[Path]]:
    """Directories in the set are deleted the moment they are first globbed: mid-inspection."""
    doomed: set[Path] = set()
    glob = Path.glob

    def glob_then_vanish(self: Path, pattern: str) -> Iterator[Path]:
        if self in doomed:
            shutil.rmtree(self)
            doomed.discard(self)
        return glob(self, pattern)

    monkeypatch.setattr(Path, "glob", glob_then_vanish)
    yield doomed


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x != "lightning"])  # directories
def test_a_directory_that_vanishes_mid_inspection_is_not_a_checkpoint(tmp_path: Path, layout: str,
                                                                        vanishing: set[Path]) -> None:
    older = make_ok(tmp_path, layout, 10)
    vanishing.add(make_ok(tmp_path, layout, 20))
    best, rejected = pick(tmp_path)
    assert not vanishing, "the fixture never fired: the test proves nothing"
    assert best is not None and best.path == older and rejected == []


def test_a_lightning_file_that_vanishes_mid_inspection_is_not_a_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    older = make_lightning(tmp_path, 10)
    doomed = make_lightning(tmp_path, 20)
    stat = Path.stat

    def stat_then_vanish(self: Path, **kw: bool) -> os.stat_result:
        result = stat(self, **kw)
        if self == doomed and os.path.exists(doomed):
            os.unlink(doomed)  # deleted between the size read and the read of its end
        return result

    monkeypatch.setattr(Path, "stat", stat_then_vanish)
    best, rejected = pick(tmp_path, "lightning")
    assert not os.path.exists(doomed), "the deletion never happened: the test proves nothing"
    assert best is not None and best.path == older and rejected == []


@pytest.mark.parametrize(("layout", "victim"), [
    ("tsup", ".metadata"), ("dcp", "__0_0.distcp"), ("hf", "model.safetensors"), ("nxd", "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt"),
])
def test_a_file_that_vanishes_after_its_check_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               layout: str, victim: str) -> None:
    older = make_ok(tmp_path, layout, 10)
    doomed = make_ok(tmp_path, layout, 20) / victim
    is_file = Path.is_file

    def is_file_then_vanish(self: Path) -> bool:
        found = is_file(self)
        if self == doomed:
            self.unlink()  # deleted between the check and the stat that follows it
        return found

    monkeypatch.setattr(Path, "is_file", is_file_then_vanish)
    best, rejected = pick(tmp_path)
    assert not doomed.exists(), "the fixture never fired: the test proves nothing"
    assert best is not None and best.path == older and rejected == []


def test_vanished_paths_give_no_verdict(tmp_path: Path) -> None:
    assert inspect(tmp_path / "step_00000040") is None
    assert inspect(tmp_path / "checkpoint-5") is None
    assert scan(tmp_path / "gone") == []
    (tmp_path / "afile").write_text("x")
    assert scan(tmp_path / "afile") == []


def test_vanishing_between_listing_and_inspection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_hf(tmp_path, 5)
    doomed = make_nxd(tmp_path, 10)
    listing = list(tmp_path.iterdir())
    shutil.rmtree(doomed)
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(listing))
    assert steps(scan(tmp_path)) == [(5, True)]


def test_inspect_one_entry(tmp_path: Path) -> None:
    d = make_megatron(tmp_path, 3)
    track(tmp_path, "3")  # inspect reads the tracker beside the entry
    assert inspect(d) == Verdict(step=3, path=d, ok=True, why="", layout="megatron")
    assert inspect(d, "hf") is None
    assert checkpoint_scan.inspect(make_hf(tmp_path, 7), "hf") is not None


def test_a_bound_picks_the_newest_complete_checkpoint_before_it(tmp_path: Path) -> None:
    from supervisor.runfiles.checkpoint_scan import pick

    for step in (20, 40, 60):
        make(tmp_path, step)
    best, _ = pick(tmp_path, before_step=60)
    assert best is not None and best.step == 40
    assert pick(tmp_path, before_step=20)[0] is None


def test_pick_skips_checkpoints_a_trainer_could_not_read(tmp_path: Path) -> None:
    for step in (20, 40, 60):
        make(tmp_path, step)
    best, rejected = pick(tmp_path, exclude={60})
    assert best is not None and best.step == 40 and rejected == []
    assert pick(tmp_path, before_step=40, exclude={20})[0] is None


def test_nxd_trainings_per_job_directories_are_followed(tmp_path: Path) -> None:
    """exp_manager writes <exp_dir>/<name>/<version>/checkpoints/<name>--step=N-...ckpt."""
    old = make_nemo(tmp_path / "hf_llama" / "2026-11-24_10-00-00" / "checkpoints", 5)
    new = make_nemo(tmp_path / "hf_llama" / "2026-11-25_09-30-00" / "checkpoints", 10)
    best, _ = pick(tmp_path, "nemo")
    assert best is not None and best.path == new and best.step == 10
    assert {v.path for v in scan(tmp_path)} == {old, new}


def test_set_aside_moves_newer_checkpoints_out_of_a_searching_trainers_way(tmp_path: Path) -> None:
    from supervisor.runfiles.user_tree import LOCAL, SET_ASIDE
    set_aside = LOCAL.set_aside

    keep = make_nemo(tmp_path / "hf_llama" / "v1" / "checkpoints", 10)
    newer = make_nemo(tmp_path / "hf_llama" / "v1" / "checkpoints", 20)
    older = make_nemo(tmp_path / "hf_llama" / "v1" / "checkpoints", 5)
    into = tmp_path / SET_ASIDE / "attempt-3"
    assert set_aside(tmp_path, "nemo", keep, 10, into) == [(newer, into / newer.name)]
    assert keep.exists() and older.exists() and (into / newer.name / "done").exists()
    best, _ = pick(tmp_path, "nemo")
    assert best is not None and best.path == keep, "what the trainer's own search now finds"
    assert set_aside(tmp_path, "nemo", None, 0, into) == [(keep, into / keep.name), (older, into / older.name)]


def test_a_torn_save_is_moved_out_of_the_way_of_a_trainer_that_takes_the_newest_by_mtime(tmp_path: Path) -> None:
    """NxD Training's check_resume takes the newest *.ckpt of its version by modification
    time, complete or not: a save cut short after the chosen one would be its pick."""
    from supervisor.runfiles.user_tree import LOCAL, SET_ASIDE
    set_aside = LOCAL.set_aside

    keep = make_nemo(tmp_path / "hf_llama" / "7" / "checkpoints", 20)
    torn = make_nemo(tmp_path / "hf_llama" / "7" / "checkpoints", 30, done=False, unfinished=True)
    into = tmp_path / SET_ASIDE / "attempt-4"
    assert set_aside(tmp_path, "nemo", keep, 20, into) == [(torn, into / torn.name)]
    left = sorted((tmp_path / "hf_llama" / "7" / "checkpoints").rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert left == [keep], "the newest *.ckpt there by mtime is the chosen one"
