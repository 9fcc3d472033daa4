"""Source integrity: a bit flip inside a real DeepSpeed shard file is reported, not converted.

The zip CRC-32 that ``torch.save`` records for every member is checked for every tensor storage
the converter (or ``verify --against``) reads, computed on the bytes as they are read.
"""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

import ucformat
from tests.cli.helpers import assert_user_error, invoke
from ucformat.errors import SourceChecksumError

FIXTURE = Path(__file__).parents[1] / "fixtures" / "data" / "z2-fp32-dsadam-ftb-ws3" / "ckpt"
OPTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def member_data_offset(path: Path, name: str) -> tuple[int, int]:
    """(file offset, size) of the bytes of zip member ``name``."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    with path.open("rb") as file:
        file.seek(info.header_offset)
        header = file.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length, info.file_size


def largest_storage(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        storages = [i for i in archive.infolist() if "/data/" in i.filename]
    return max(storages, key=lambda info: info.file_size).filename


def damaged_copy(tmp_path: Path, member: str | None = None) -> tuple[Path, str]:
    """A copy of the fixture checkpoint with one byte flipped in the middle of one member of
    rank 1's optimizer file (default: its largest storage, the fp32 flat partition)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt)
    (shard,) = ckpt.glob(f"*/{OPTIM}")
    member = member or largest_storage(shard)
    offset, size = member_data_offset(shard, member)
    data = bytearray(shard.read_bytes())
    data[offset + size // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return ckpt, member


def test_convert_refuses_a_flipped_byte(tmp_path: Path) -> None:
    ckpt, member = damaged_copy(tmp_path)
    with pytest.raises(SourceChecksumError, match=f"zip member '{member}'.*fails its CRC-32"):
        ucformat.convert(ckpt, tmp_path / "api.ucf")
    assert not (tmp_path / "api.ucf").exists(), "nothing is left that could look like a store"
    line = assert_user_error(
        invoke("convert", ckpt, tmp_path / "cli.ucf", "-q"), OPTIM, member, "CRC-32"
    )
    assert "--no-check-source" in line
    assert not (tmp_path / "cli.ucf").exists()


def test_no_check_source_converts_the_damage(tmp_path: Path) -> None:
    ckpt, _ = damaged_copy(tmp_path)
    good = ucformat.convert(FIXTURE, tmp_path / "good.ucf")
    done = invoke("convert", ckpt, tmp_path / "bad.ucf", "-q", "--no-check-source")
    assert done.exit_code == 0, done.output
    a, b = ucformat.open(tmp_path / "good.ucf"), ucformat.open(tmp_path / "bad.ucf")
    differing = [
        (name, state)
        for name, entry in good.params.items()
        for state in entry.states
        if not torch.equal(a.read(name, state), b.read(name, state))
    ]
    assert len(differing) == 1, "the flipped byte lands in one stored value"


def test_verify_against_a_damaged_source(tmp_path: Path) -> None:
    ucformat.convert(FIXTURE, tmp_path / "store.ucf")
    assert invoke("verify", tmp_path / "store.ucf", "--against", FIXTURE).exit_code == 0
    ckpt, member = damaged_copy(tmp_path)
    with pytest.raises(SourceChecksumError, match="fails its CRC-32"):
        ucformat.verify(tmp_path / "store.ucf", against=ckpt)
    assert_user_error(
        invoke("verify", tmp_path / "store.ucf", "--against", ckpt), OPTIM, member, "CRC-32"
    )


def test_a_flipped_pickle_byte_is_a_checksum_error(tmp_path: Path) -> None:
    shard = next(FIXTURE.glob(f"*/{OPTIM}"))
    with zipfile.ZipFile(shard) as archive:
        pickle = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
    ckpt, _ = damaged_copy(tmp_path, pickle)
    assert_user_error(invoke("convert", ckpt, tmp_path / "x.ucf", "-q"), OPTIM, "CRC-32")
