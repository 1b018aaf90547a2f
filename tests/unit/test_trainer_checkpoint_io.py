"""Checkpoint I/O at the hardware's pace (trainer/checkpoint_io.py, trainer/state_file.py,
trainer/staging.py), on plain tensors in one process: what is written is what comes
back, every file is hashed as it is written and checked as it is read, and a changed
byte fails the read with the manifest's words."""

from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from trainer import checkpoint_io, state_file
from trainer import checkpoint_layout as layout
from trainer.checkpoint_io import HashingWriter, VerifyingReader, io_threads, read_verified, tensor_in_place
from trainer.staging import Staging
from wire.errors import CheckpointMismatch
from wire.files import MANIFEST_FILE, read_manifest


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(300, 200, generator=g), "b": torch.randn(200, generator=g),
                  "h": torch.randn(64, 8, generator=g).to(torch.bfloat16)},
        "optimizer": {"state": {"w": {"step": torch.tensor(7.0), "exp_avg": torch.randn(300, 200, generator=g)}},
                      "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": ["w"], "fused": None}]},
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_io_threads_share_the_nodes_cores_between_two_and_eight() -> None:
    assert io_threads(1, cores=16) == 8 and io_threads(8, cores=16) == 2 and io_threads(4, cores=16) == 4
    assert io_threads(1, cores=2) == 2


# --- the persistent tier's files ----------------------------------------------------------


def saved(tmp_path: Path, threads: int = 3) -> tuple[Path, dict[str, dict[str, Any]]]:
    directory = tmp_path / "ck"
    writer = HashingWriter(directory, threads=threads)
    dcp_save(state(), storage_writer=writer, no_dist=True)
    return directory, writer.entries


def test_each_file_is_hashed_as_written_and_the_entries_are_what_a_read_back_gives(tmp_path: Path) -> None:
    directory, entries = saved(tmp_path)
    assert len([n for n in entries if n.endswith(".distcp")]) == 3, "one file per writer thread"
    assert set(entries) == set(layout.manifest_names(directory))  # .metadata included, by its final name
    for name, entry in entries.items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}, name


def test_a_verified_read_loads_what_was_saved(tmp_path: Path) -> None:
    directory, entries = saved(tmp_path)
    into = state()
    for t in (into["model"]["w"], into["model"]["b"], into["optimizer"]["state"]["w"]["exp_avg"]):
        t.zero_()
    reader = VerifyingReader(directory, manifest=entries, threads=2)
    dcp_load(into, storage_reader=reader, no_dist=True)
    assert same(into["model"], state()["model"])
    assert torch.equal(into["optimizer"]["state"]["w"]["exp_avg"], state()["optimizer"]["state"]["w"]["exp_avg"])
    assert reader.bytes_read == sum(e["size"] for n, e in entries.items() if n != ".metadata")


def test_a_verified_read_copies_the_tensors_from_the_mapped_files_without_torch_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory, entries = saved(tmp_path)
    into = state()
    for t in (into["model"]["w"], into["model"]["h"], into["optimizer"]["state"]["w"]["exp_avg"]):
        t.zero_()
    loaded: list[Any] = []
    real_load = torch.load
    monkeypatch.setattr(checkpoint_io.torch, "load", lambda *a, **k: loaded.append(a) or real_load(*a, **k))
    dcp_load(into, storage_reader=VerifyingReader(directory, manifest=entries, threads=2), no_dist=True)
    assert same(into["model"], state()["model"])
    tensors_unpickled = [a for a in loaded if not isinstance(a[0], io.BytesIO)]  # (DCP's planner unpickles
    assert loaded and tensors_unpickled == [], "plain tensors: found in their records"  # the non-tensors)


def record_of(tensor: torch.Tensor) -> memoryview:
    out = io.BytesIO()
    torch.save(tensor, out)
    return memoryview(out.getvalue())


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).view(3, 4),
    torch.arange(12, dtype=torch.float32).view(3, 4).t(),  # strided: its storage's order differs
    torch.arange(6, dtype=torch.bfloat16), torch.tensor(7.0), torch.tensor([True, False]),
    torch.arange(5, dtype=torch.int64), torch.empty(0, 3)], ids=str)
def test_a_plain_tensor_is_read_in_place_from_its_torch_save_record(tensor: torch.Tensor) -> None:
    back = tensor_in_place(record_of(tensor))
    assert back is not None and back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_anything_else_is_left_to_torch_load() -> None:
    assert tensor_in_place(record_of(torch.nn.Parameter(torch.ones(2)))) is None  # another class
    assert tensor_in_place(record_of(torch.ones(2, dtype=torch.complex64))) is None  # a dtype not listed
    assert tensor_in_place(record_of({"a": torch.ones(2)})) is None  # not one tensor
    assert tensor_in_place(memoryview(b"PK\x03\x04 not a zip")) is None
    evil = io.BytesIO()
    torch.save(torch.ones(2), evil)
    data = bytearray(evil.getvalue())
    at = bytes(data).index(b"_rebuild_tensor_v2")
    data[at:at + 18] = b"_rebuild_parameter"  # a name a plain tensor's pickle does not use
    assert tensor_in_place(memoryview(bytes(data))) is None


def test_a_changed_byte_fails_the_read_before_its_file_is_used(tmp_path: Path) -> None:
    directory, entries = saved(tmp_path)
    shard = max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointMismatch, match=rf"not what was written: {shard.name}'s BLAKE3 is"):
        read_verified(shard, entries[shard.name])
    with pytest.raises(CheckpointException, match="not what was written"):  # every rank's error, gathered
        dcp_load(state(), storage_reader=VerifyingReader(directory, manifest=entries, threads=2), no_dist=True)


def test_a_format_1_manifest_of_sha256_still_verifies(tmp_path: Path) -> None:
    directory, entries = saved(tmp_path, threads=1)
    old = {name: {"size": e["size"], "sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest()}
           for name, e in entries.items()}
    (directory / MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": old}))
    manifest = read_manifest(directory)
    assert manifest == old
    assert layout.manifest_problems(directory, old, sorted(old)) == []
    dcp_load(state(), storage_reader=VerifyingReader(directory, manifest=manifest, threads=2), no_dist=True)
    shard = next(directory.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")
    with pytest.raises(CheckpointMismatch, match="SHA256 is"):
        read_verified(shard, old[shard.name])


def test_a_manifest_of_an_unknown_format_or_hash_is_refused(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": 3, "files": {}}))
    with pytest.raises(CheckpointMismatch, match="not a manifest of format 1 or 2"):
        read_manifest(tmp_path)
    with pytest.raises(CheckpointMismatch, match="no hash this trainer knows"):
        layout.entry_hash({"size": 3, "md5": "x"})


# --- the memory tier's flat files ---------------------------------------------------------


def test_a_state_file_holds_the_tree_and_every_tensor_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "rank_00000.pt"
    size = state_file.write(path, {"step": 25}, state(), threads=3)
    assert path.stat().st_size == size
    with state_file.mapped(path) as data:
        meta, back = state_file.read(data)
        assert meta == {"step": 25} and same(back, state())
        assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95), "a tuple stays a tuple"
        del back


def test_copy_into_fills_live_tensors_in_pieces_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_file, "_PIECE", 4096)  # many pieces of each tensor
    src = state()
    pairs = [(torch.empty_like(t), t) for t in (src["model"]["w"], src["model"]["h"], torch.tensor(3.5))]
    state_file.copy_into(pairs, threads=3)
    assert all(torch.equal(dst, s) for dst, s in pairs)


def test_a_state_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(state_file.StateFileError, match="not a state file"):
        state_file.read(memoryview(bytearray(b"PK\x03\x04" + bytes(100))))
    path = tmp_path / "cut.pt"
    state_file.write(path, {}, state(), threads=1)
    data = bytearray(path.read_bytes()[:-5000])  # cut short
    with pytest.raises(state_file.StateFileError, match="does not hold"):
        state_file.read(memoryview(data))


# --- staging --------------------------------------------------------------------------------


def test_staging_reuses_its_host_buffers_and_copies_what_the_state_is_now() -> None:
    live = state()
    staging = Staging(torch.device("cpu"))
    staging.prepare(live)
    first = staging.stage(live)
    live["model"]["w"].add_(1.0)
    second = staging.stage(live)
    w = second["model"]["w"]
    assert w.data_ptr() == first["model"]["w"].data_ptr() != live["model"]["w"].data_ptr(), "one buffer, reused"
    assert torch.equal(w, live["model"]["w"])
    live["model"]["w"].add_(1.0)
    assert not torch.equal(w, live["model"]["w"]), "a copy: training goes on beside it"
    staging.close()


def test_the_buffers_are_laid_out_before_any_copy_and_every_copy_uses_them() -> None:
    live = state()
    staging = Staging(torch.device("cpu"))
    staging.lay_out(live)  # what prepare does first, on its thread
    laid_out = {host.data_ptr() for host in staging._stager._cached_storage_mapping.values()}  # prepare's
    tensors = [live["model"]["w"], live["model"]["b"], live["model"]["h"],
               live["optimizer"]["state"]["w"]["exp_avg"], live["optimizer"]["state"]["w"]["step"]]
    assert len(laid_out) == len(tensors)
    copied = staging.stage(live)
    got = [copied["model"]["w"], copied["model"]["b"], copied["model"]["h"],
           copied["optimizer"]["state"]["w"]["exp_avg"], copied["optimizer"]["state"]["w"]["step"]]
    assert {t.untyped_storage().data_ptr() for t in got} == laid_out, "no buffer allocated by a save"
    assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))
    staging.close()


def test_a_copy_beside_training_is_fenced_before_the_state_changes_and_says_what_it_cost() -> None:
    live = state()
    staging = Staging(torch.device("cpu"))
    copy = staging.begin(live)
    copy.fence()  # the next optimizer step: it waits for whatever of the copy is left
    live["model"]["w"].add_(1.0)
    assert same(copy.done(), state()), "the state as it was when the copy began"
    assert 0.0 <= copy.blocked_s(timeout_s=1.0) < 5.0
    staging.close()


def test_each_file_is_verified_by_the_rank_that_wrote_it_and_read_by_range_by_the_others(tmp_path: Path) -> None:
    from trainer.checkpoint_io import verifier

    assert [verifier(f"__{r}_0.distcp", 2) for r in range(4)] == [0, 1, 0, 1]  # written by 4, read by 2
    assert verifier("other.bin", 3) == verifier("other.bin", 3) in (0, 1, 2)
    directory, entries = saved(tmp_path)
    shard = max(directory.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Rank 1 of 2 verifies none of rank 0's files: it reads what it needs by range and trusts
    # rank 0's check (which fails the load of every rank: the test above).
    reader = VerifyingReader(directory, manifest=entries, threads=2, rank=1, world_size=2)
    dcp_load(state(), storage_reader=reader, no_dist=True)
    needed = sum(e["size"] for n, e in entries.items() if n != ".metadata")
    assert 0 < reader.bytes_read <= needed
    with pytest.raises(CheckpointException, match="not what was written"):
        dcp_load(state(), storage_reader=VerifyingReader(directory, manifest=entries, threads=2, rank=0,
                                                         world_size=2), no_dist=True)


def test_without_the_blake3_package_new_manifests_use_sha256_and_blake3_ones_say_what_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from wire.errors import UsageError

    monkeypatch.setitem(sys.modules, "blake3", None)  # as on a node where it is not installed
    assert layout.hash_name() == "sha256"
    with pytest.raises(UsageError, match="blake3 package is not installed"):
        layout.new_hasher("blake3")
