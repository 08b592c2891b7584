"""CI check: the install resolves, beside the newest CUDA build of torch on PyPI, to a set that
holds NVRTC, the CUDA headers and nvdisasm.

CI itself installs the CPU build of torch, whose resolution differs: beside torch's CUDA pins pip
once settled cuda-toolkit on 13.0.x, whose metapackage has no `nvdisasm` extra, and every SASS
feature failed with "nvdisasm not found" for GPU users only. This resolves (metadata only, nothing
is installed: `pip install --dry-run --report`) autoflash's own requirements from pyproject.toml
together with `torch` as a fresh GPU user's `pip install` would get it, and fails unless the
resolved set has each component wheel.
"""
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

NEEDED = {
    "nvidia-cuda-nvrtc": "NVRTC (libnvrtc, the compiler)",
    "nvidia-cuda-runtime": "the CUDA headers (cuda_fp16.h, cuda_bf16.h)",
    "nvidia-cuda-nvdisasm": "nvdisasm (render --sass, bench sass)",
}


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = ["torch"] + [d for d in deps if not d.startswith("torch")]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                               "--report", str(report), *requirements], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"check_cuda_deps: pip could not resolve {requirements}:\n{proc.stderr}", file=sys.stderr)
            return 1
        resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    torch = resolved.get("torch")
    cuda_build = any(name.startswith("nvidia-") and name not in NEEDED for name in resolved)
    print(f"check_cuda_deps: torch {torch} ({'CUDA' if cuda_build else 'no CUDA'} build) with "
          + ", ".join(f"{n} {resolved.get(n, '-')}" for n in NEEDED))
    missing = [f"{n} ({what})" for n, what in NEEDED.items() if n not in resolved]
    warned = [line for line in proc.stderr.splitlines() if "does not provide the extra" in line]
    if not cuda_build:
        print("check_cuda_deps: the newest torch resolved without CUDA wheels; expected its CUDA build", file=sys.stderr)
        return 1
    if missing or warned:
        print("check_cuda_deps: missing " + "; ".join(missing) + "".join(f"\n  pip: {w}" for w in warned),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
