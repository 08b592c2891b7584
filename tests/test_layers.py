"""The package's folders are the pipeline, and imports run one way: kernels (config, templates,
compile, launch) import nothing from the layers built on them. The emulator reaches the launchers
only as the host backend they call (kernels/backend.py), registered by the package root."""
import ast
from pathlib import Path

import autoflash

ROOT = Path(autoflash.__file__).parent
LAYERS = ("kernels", "emulation", "reference", "tuning", "dispatch", "bench")


def _imports(path: Path):
    """(line, module) of every autoflash import in a file, function-level ones included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)


def test_kernels_import_no_layer_below():
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in sorted((ROOT / "kernels").rglob("*.py"))
             for line, m in _imports(p) if m.startswith("autoflash.") and not m.startswith("autoflash.kernels")]
    assert not wrong, "\n".join(wrong)


def test_emulation_and_reference_import_no_later_layer():
    later = tuple(f"autoflash.{name}" for name in LAYERS[3:])
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {m}" for layer in ("emulation", "reference")
             for p in sorted((ROOT / layer).rglob("*.py")) for line, m in _imports(p) if m.startswith(later)]
    assert not wrong, "\n".join(wrong)


def test_cpu_tensors_reach_the_emulator_through_the_host_backend():
    import torch

    from autoflash.kernels import backend
    from autoflash.kernels.launch import flash_forward

    assert backend.host() is not None and backend.host().profile() is None  # registered, not in force
    q = torch.randn(1, 1, 16, 32, dtype=torch.float16)
    with autoflash.emulate("a100"):
        assert backend.host().profile().name == "a100"
        out = flash_forward(q, q, q)
    out = out[0] if isinstance(out, tuple) else out
    ref = torch.softmax(q.float() @ q.float().transpose(-1, -2) / 32 ** 0.5, -1) @ q.float()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)
