"""16 of these at once: does NVRTC's log come back empty, with what size, which libnvrtc is mapped."""
import os, sys, time
import torch, cupy  # noqa: F401 -- loaded as in the test workers
from autoflash.kernels import compiler, defaults
from autoflash.kernels.codegen import render
from autoflash.kernels.gpus import get_profile

wid = int(sys.argv[1])
p = get_profile("h100")
cfgs = [defaults.default_config(64, "bf16", True, p), defaults.default_config(96, "bf16", True, p),
        defaults.default_config(160, "bf16", False, p), defaults.default_config(256, "fp16", False, p),
        defaults.default_backward_config(40, "bf16", False, p), defaults.default_config(128, "fp16", True, p)]
cfgs = cfgs[wid % len(cfgs):] + cfgs[:wid % len(cfgs)]
nv = compiler._nvrtc()
for cfg in cfgs:
    arch = "sm_90a" if cfg.family == "sm90" else "sm_90"
    opts = [f"--gpu-architecture={arch}", *compiler.BASE_OPTIONS, f"-I{compiler.templates_dir()}",
            f"-I{compiler.cuda_include_dir()}"]
    src = render(cfg)
    for attempt in range(3):
        prog = compiler._check(nv.nvrtcCreateProgram(src.encode(), f"{cfg.name}.cu".encode(), 0, [], []), "c")
        o = [x.encode() for x in opts]
        err = nv.nvrtcCompileProgram(prog, len(o), o)[0]
        size = compiler._check(nv.nvrtcGetProgramLogSize(prog), "s")
        buf = b" " * size
        ret = nv.nvrtcGetProgramLog(prog, buf)
        csize = compiler._check(nv.nvrtcGetCUBINSize(prog), "cs")
        nv.nvrtcDestroyProgram(prog)
        ok = b"Compiling entry function" in buf
        if ok:
            break
        print(f"w{wid} EMPTY {cfg.name} attempt {attempt} err {int(err)} logsize {size} cubin {csize} ret {ret!r:.80} "
              f"head {buf[:120]!r}", flush=True)
maps = {l.split()[-1] for l in open("/proc/self/maps") if "nvrtc" in l}
print(f"w{wid} done; nvrtc mapped: {sorted(maps)}", flush=True)
