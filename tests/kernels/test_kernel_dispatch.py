import ast
import pathlib

import torch

import gyrfalcon.kernels as K
from gyrfalcon import envs
from gyrfalcon.kernels import common as _common

KERNELS_DIR = pathlib.Path(K.__file__).parent


def test_package_reexports_dispatchers():
    for name in ["rms_norm", "apply_rotary", "store_kv", "paged_attention", "paged_decode_attention",
                 "silu_and_mul"]:
        assert callable(getattr(K, name))


def test_cpu_tensors_use_reference(monkeypatch):
    x = torch.randn(3, 16)
    assert not _common.use_triton(x)
    monkeypatch.setenv("GYRFALCON_KERNELS", "ref")
    envs.refresh()
    assert not _common.use_triton(x)
    torch.testing.assert_close(K.silu_and_mul(torch.randn(2, 8)).shape, torch.Size([2, 4]))
    out, res = K.rms_norm(x, torch.ones(16), 1e-6, residual=x)
    assert out.shape == res.shape == x.shape


def test_env_var_forces_reference(monkeypatch):
    class FakeCuda:
        is_cuda = True

    monkeypatch.setattr(_common, "HAS_TRITON", True)
    assert _common.use_triton(FakeCuda())
    monkeypatch.setenv("GYRFALCON_KERNELS", "ref")
    envs.refresh()
    assert not _common.use_triton(FakeCuda())


def test_kernels_import_nothing_but_kernels_and_no_modules():
    # kernels/ is the bottom of the import graph: no nn.Module, nothing else from gyrfalcon but its envs.
    for path in KERNELS_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
                names = []
            else:
                continue
            for m in mods:
                if m == "gyrfalcon":
                    assert set(names) <= {"envs"}, f"{path.name} imports {names} from gyrfalcon"
                elif m.startswith("gyrfalcon"):
                    assert m.startswith("gyrfalcon.kernels"), f"{path.name} imports {m}"
                assert m not in ("torch.nn",) or not set(names) & {"Module"}, f"{path.name} imports nn.Module"
        assert "nn.Module" not in path.read_text(), path.name


def test_pdl_never_on_cpu_and_off_by_env(monkeypatch):
    """Programmatic dependent launch is never used for CPU tensors (or under the interpreter), not even
    in the pre-capture warm-up; GYRFALCON_PDL=0 turns it off; with it off no launch keyword is added."""
    x = torch.randn(1, 4)
    monkeypatch.delenv("GYRFALCON_PDL", raising=False)
    assert not _common.use_pdl(x)
    with _common.pdl_warmup():
        assert not _common.use_pdl(x)
    assert not _common._PDL_WARMUP[0]
    monkeypatch.setenv("GYRFALCON_PDL", "0")
    envs.refresh()
    assert not _common.use_pdl(x)
    assert _common.pdl_launch_kwargs(False) == {}
    monkeypatch.delenv("GYRFALCON_PDL")
    envs.refresh()
    assert _common.pdl_launch_kwargs(True) == {"launch_pdl": True}
    monkeypatch.setenv("GYRFALCON_PDL", "serial")  # the PDL kernel variants, launched one after another
    envs.refresh()
    assert _common.pdl_launch_kwargs(True) == {}



def test_pdl_single_rows_only(monkeypatch):
    """use_pdl admits single rows (the batch-1 graphs) only, never an empty launch, and only inside a capture or
    its warm-up. (pdl_possible stubbed: its device conditions need a GPU.)"""
    monkeypatch.setattr(_common, "pdl_possible", lambda t: True)
    with _common.pdl_warmup():
        assert _common.use_pdl(torch.zeros(1, 4)) and not _common.use_pdl(torch.zeros(16, 4))
        assert not _common.use_pdl(torch.zeros(0, 4))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not _common.use_pdl(torch.zeros(1, 4))  # outside a capture or its warm-up
