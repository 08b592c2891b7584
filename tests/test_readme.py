"""The README's first screen works as written: the two commands (set-up + tuner dry run, and the
test command CI runs), the example for any machine and the GPU example (run here on the emulator,
its sizes cut down), and every link to a section or a docs/ page leads somewhere."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def _run(code: str, **env) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_the_two_commands_come_first_and_ci_runs_the_test_command():
    first_screen = README[:README.index("## Try it on any machine")]
    commands = re.findall(r"```bash\n(.*?)\n```", first_screen, re.S)
    assert len(commands) == 2
    setup, test = commands
    assert setup.startswith('pip install -e ".[') and "python -m autoflash.tune" in setup and "--dry-run" in setup
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].replace("python3 ", "python ") == test  # CI ends with the README's test command


def test_the_example_for_any_machine_runs_on_the_emulator():
    code = re.search(r"```python\n(.*?)```", _section("Try it on any machine"), re.S).group(1)
    out = _run(code)
    assert "path: autoflash kernels (emulated on the CPU) on a100" in out
    assert float(re.search(r"max \|out - fp32 SDPA\| = (\S+)", out).group(1)) < 5e-2


def test_the_gpu_example_runs_on_the_emulator_at_small_sizes():
    code = re.search(r"```python\n(.*?)```", _section("On a GPU"), re.S).group(1)
    sizes = 'dev, B, H, HKV, L, D = "cuda", 4, 32, 8, 4096, 128'
    assert sizes in code  # the line this test swaps for CPU tensors
    out = _run(code.replace(sizes, 'dev, B, H, HKV, L, D = "cpu", 1, 4, 2, 40, 64'), AUTOFLASH_EMULATE="a100")
    assert "path: autoflash kernels (emulated on the CPU) on a100" in out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_links_lead_somewhere(page):
    path = ROOT / page
    text = path.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page != "README.md"
    for link in links:
        if link.startswith("http"):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{page}: {link} -> {file}"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", file.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page}: {link}: no heading with anchor {anchor}"


def test_fp32_is_described_in_one_place():
    """The README's table says what runs fp32; no other user-facing page restates it."""
    assert "the SIMT kernels¹" in _section("What runs where")
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        text = page.read_text()
        if page.name == "README.md":
            text = text.replace(_section("What runs where"), "").replace(_section("How it works"), "")
        assert "fp32 on a SIMT path" not in text, page
