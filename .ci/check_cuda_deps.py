"""CI check: each CUDA stack's install (autoflash[cu12], autoflash[cu13]) resolves beside torch's
CUDA builds of the same major on PyPI to a set that holds NVRTC, the CUDA headers, nvdisasm,
cuda-bindings and CuPy of that major.

CI itself installs the CPU build of torch, whose resolution differs: beside torch's CUDA pins pip
once settled cuda-toolkit on 13.0.x, whose metapackage has no `nvdisasm` extra, and every SASS
feature failed with "nvdisasm not found" for GPU users only. This resolves (metadata only, nothing
is installed: `pip install --dry-run --report`) autoflash's own requirements from pyproject.toml,
with one extra, together with torch as a fresh GPU user's `pip install` would get it, and fails
unless the resolved set has each component at the stack's major and torch is a CUDA build of it.

torch on PyPI (x86-64 Linux): 2.4 to 2.10 are CUDA 12 builds (2.4 pins NVRTC 12.1, 2.5/2.6 12.4,
2.7 12.6, 2.8 to 2.10 12.8), 2.11 on CUDA 13 builds (cuda-toolkit 13.0.x). PyTorch's own wheel
index (other CUDA builds of each release) is not reachable from CI, so only PyPI's are resolved:
each stack beside the newest torch of its major, and CUDA 12 also beside the oldest torch our
`torch>=` admits (its NVRTC 12.1 pin is the floor of autoflash[cu12]). The resolutions run at once:
each waits on the index, not the CPU.
"""
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# extra -> {wheel: (what it gives, the major its version must have)}
STACKS = {
    "cu12": {
        "nvidia-cuda-nvrtc-cu12": ("NVRTC (libnvrtc, the compiler)", 12),
        "nvidia-cuda-runtime-cu12": ("the CUDA headers (cuda_fp16.h, cuda_bf16.h)", 12),
        "nvidia-cuda-nvdisasm": ("nvdisasm (render --sass, bench sass); no 12.x wheel exists", 13),
        "cuda-bindings": ("NVRTC's Python API", 12),
        "cupy-cuda12x": ("CuPy (loads and launches the cubins)", 14),
    },
    "cu13": {
        "nvidia-cuda-nvrtc": ("NVRTC (libnvrtc, the compiler)", 13),
        "nvidia-cuda-runtime": ("the CUDA headers (cuda_fp16.h, cuda_bf16.h)", 13),
        "nvidia-cuda-nvdisasm": ("nvdisasm (render --sass, bench sass)", 13),
        "cuda-bindings": ("NVRTC's Python API", 13),
        "cupy-cuda13x": ("CuPy (loads and launches the cubins)", 14),
    },
}
# Another stack's CuPy in the set would overwrite this one's `cupy` package.
FORBIDDEN = {"cu12": ("cupy-cuda13x",), "cu13": ("cupy-cuda12x",)}
# (extra, torch requirement, the CUDA major that torch build must have)
CASES = (
    ("cu13", "torch>=2.11", 13),  # the newest CUDA 13 build (2.11's NVRTC pin, 13.0.x, is the same)
    ("cu12", "torch>=2.4,<2.11", 12),  # the newest CUDA 12 build (2.10: NVRTC 12.8, cuda-bindings 12.9.4)
    ("cu12", "torch==2.4.*", 12),  # the oldest our torch>=2.4 admits (NVRTC 12.1)
)


def torch_cuda_major(requires: list[str]) -> int | None:
    """The CUDA major a torch wheel is built for, from the NVIDIA wheels it requires."""
    for req in requires:
        if m := re.match(r"cuda-toolkit\b.*?==\s*(\d+)\.", req):
            return int(m.group(1))
        if m := re.match(r"nvidia-[\w-]+-cu(\d+)\b", req):
            return int(m.group(1))
    return None


def resolve(extra: str, torch_req: str, requirements: list[str]) -> tuple[dict, str, str]:
    """({name: (version, requires_dist)}, pip's stderr, an error or "") for one stack."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                               "--report", str(report), torch_req, *requirements], capture_output=True, text=True)
        if proc.returncode != 0:
            return {}, proc.stderr, f"pip could not resolve {[torch_req, *requirements]}:\n{proc.stderr}"
        resolved = {i["metadata"]["name"].lower(): (i["metadata"]["version"], i["metadata"].get("requires_dist", []))
                    for i in json.loads(report.read_text())["install"]}
    return resolved, proc.stderr, ""


def check(extra: str, torch_req: str, torch_major: int, resolved: dict, stderr: str) -> list[str]:
    problems = []
    torch_version, torch_requires = resolved.get("torch", ("-", []))
    major = torch_cuda_major(torch_requires)
    if major != torch_major:
        problems.append(f"{torch_req} resolved to torch {torch_version}, a "
                        f"{'CUDA %d' % major if major else 'non-CUDA'} build; expected a CUDA {torch_major} build")
    for name, (what, want) in STACKS[extra].items():
        version = resolved.get(name, ("-",))[0]
        if name not in resolved:
            problems.append(f"missing {name} ({what})")
        elif int(version.split(".")[0]) != want:
            problems.append(f"{name} {version} ({what}): expected {want}.x")
    problems += [f"{name} is in the set: two CuPy builds overwrite each other" for name in FORBIDDEN[extra]
                 if name in resolved]
    problems += [f"pip: {line}" for line in stderr.splitlines() if "does not provide the extra" in line]
    return problems


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    base = [d for d in project["dependencies"] if not d.startswith("torch")]
    jobs = [(extra, torch_req, major, base + project["optional-dependencies"][extra])
            for extra, torch_req, major in CASES]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: resolve(*job[:2], job[3]), jobs))
    failed = False
    for (extra, torch_req, major, _), (resolved, stderr, error) in zip(jobs, results):
        problems = [error] if error else check(extra, torch_req, major, resolved, stderr)
        torch_version = resolved.get("torch", ("-",))[0]
        print(f"check_cuda_deps: autoflash[{extra}] beside {torch_req} -> torch {torch_version} "
              f"(CUDA {torch_cuda_major(resolved.get('torch', ('', []))[1]) or '-'}) with "
              + ", ".join(f"{n} {resolved.get(n, ('-',))[0]}" for n in STACKS[extra]))
        if problems:
            failed = True
            print(f"check_cuda_deps: autoflash[{extra}] beside {torch_req}: " + "; ".join(problems), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
