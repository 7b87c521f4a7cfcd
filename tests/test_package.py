"""The package's face: what ``import ascend_vlm`` registers and exposes, checked in fresh
processes (in this one, other tests have imported every submodule already)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ascend_vlm

README = Path(__file__).resolve().parents[1] / "README.md"

EXPORT = """
import sys
import torch
import ascend_vlm


class Block(torch.nn.Module):
    def forward(self, x, mask, weight, cos, sin):
        h = ascend_vlm.ops.rms_norm(x, weight)
        h = ascend_vlm.ops.rotary_embedding(h, cos, sin)
        h = ascend_vlm.ops.fused_attention(h, h, h, mask, causal=True)
        return ascend_vlm.ops.swiglu(torch.cat([h, h.flip(-1)], dim=-1))


gen = torch.Generator().manual_seed(0)
x = torch.randn(2, 2, 5, 8, generator=gen)
mask = torch.ones(2, 5, dtype=torch.bool)
mask[1, :2] = False
angles = torch.randn(5, 4, generator=gen)
inputs = (x, mask, torch.rand(8, generator=gen), *(f(angles).repeat(1, 2) for f in (torch.cos, torch.sin)))
program = torch.export.export(Block(), inputs)
torch.export.save(program, sys.argv[1])
torch.save((inputs, Block()(*inputs)), sys.argv[2])
"""

LOAD = """
import sys
import torch
import ascend_vlm

program = torch.export.load(sys.argv[1])
inputs, expected = torch.load(sys.argv[2])
torch.testing.assert_close(program.module()(*inputs), expected, atol=0, rtol=0)
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_exported_program_loads_and_runs_after_import_ascend_vlm(tmp_path) -> None:
    program, data = str(tmp_path / "block.pt2"), str(tmp_path / "io.pt")
    exported = _run(EXPORT, program, data)
    assert exported.returncode == 0, exported.stderr[-2000:]
    loaded = _run(LOAD, program, data)
    assert loaded.returncode == 0, loaded.stderr[-2000:]


def test_import_registers_every_op_and_exposes_the_public_submodules() -> None:
    code = """
    import sys
    import torch
    import ascend_vlm

    print(ascend_vlm.kernel_backend.active_backend(), callable(ascend_vlm.testing.install_mock_npu))
    print([name for name in sys.argv[1:] if hasattr(torch.ops.ascend_vlm, name)])
    """
    names = sorted(ascend_vlm.ops.OPS)
    result = _run(code, *names)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["cpu True", str(names)]


def test_readme_public_api_line_lists_exactly_the_public_names() -> None:
    text = README.read_text(encoding="utf-8")
    line = re.search(r"^Public API: (.*?)\. Everything else is private\.", text, re.M | re.S)
    assert line is not None, "README: no 'Public API: ... Everything else is private.' line"
    listed = re.findall(r"`(?:ascend_vlm\.)?(\w+)`", line.group(1))
    assert sorted(listed) == sorted(ascend_vlm.__all__)
    for name in ascend_vlm.__all__:
        assert getattr(ascend_vlm, name) is not None


def test_the_extension_reports_the_package_version() -> None:
    from ascend_vlm import _C

    assert _C.__version__ == ascend_vlm.__version__


def test_raw_acl_calls_are_not_on_the_extensions_public_surface() -> None:
    from ascend_vlm import _C

    public = {name for name in dir(_C) if not name.startswith("_")}
    assert "acl" not in public
    assert callable(_C._testing_acl.malloc)
