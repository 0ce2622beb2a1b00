import subprocess
import sys

import pytest

from graphrt.passes import PASS_NAMES, PIPELINE, PassManager
from graphrt.passes.fuse_slot_mapping import FuseSlotMapping

UUID_CMD = "from graphrt.passes import PassManager; print(PassManager('inductor').uuid())"


def test_uuid_is_stable_across_processes():
    out = {
        subprocess.run([sys.executable, "-c", UUID_CMD], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    }
    assert out == {PassManager("inductor").uuid()}


def test_uuid_changes_with_disabled_passes_backend_and_options():
    base = PassManager("inductor").uuid()
    assert PassManager("inductor", ["fuse_sampling"]).uuid() != base
    assert PassManager("eager").uuid() != base
    assert FuseSlotMapping(variant=2).uuid() != FuseSlotMapping().uuid()


def test_uuid_changes_when_a_pass_source_changes(tmp_path, monkeypatch):
    before = FuseSlotMapping().uuid()
    edited = tmp_path / "edited_pass.py"
    edited.write_text("# an edited copy of the pass source\n")
    monkeypatch.setattr(FuseSlotMapping, "sources", lambda self: [str(edited)])
    first = FuseSlotMapping().uuid()
    edited.write_text("# edited again\n")
    assert FuseSlotMapping().uuid() != first != before


def test_every_entry_has_a_reason_and_unknown_names_are_refused():
    assert all(e.reason for e in PIPELINE)
    assert len(set(PASS_NAMES)) == len(PASS_NAMES)
    with pytest.raises(ValueError, match="fuse_atention.*fuse_attention"):
        PassManager("inductor", ["fuse_atention"])


def test_inductor_leaves_the_norm_fusion_off():
    names = [p.name for p in PassManager("inductor").passes]
    assert "fuse_add_rms_norm" not in names and "fuse_attention" in names
    assert "fuse_add_rms_norm" in [p.name for p in PassManager("torchair").passes]
