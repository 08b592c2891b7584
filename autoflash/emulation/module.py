"""A built kernel library loaded with ctypes, used the way the GPU path uses a cupy.RawModule:
`load_functions(config, sanitize)` gives {symbol: function}, and a function is called as
fn(grid, block, args, shared_mem=...), args being torch tensors (passed as pointers) and each
scalar parameter's bytes (launch.KernelParams packs them, as for a GPU launch; numpy scalars of the
parameter's type also do). CPU tensors' memory is used in place: no copies."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import torch

from autoflash.emulation.build import EmulationError, build_library
from autoflash.emulation.limits import LaunchRefused, check_launch
from autoflash.kernels.codegen import render
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.tensor_map import TiledMap


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem the sanitizer (or, failing a plain launch, the emulator's own checks) found."""

    kind: str  # race, out-of-bounds, misaligned, uninitialized, barrier, undefined, launch
    kernel: str
    location: str  # template file:line, e.g. templates/flash_fwd.cu.j2:162
    block: tuple[int, int, int]
    thread: int
    detail: str
    frames: tuple[str, ...]  # the kernel-side call chain, innermost first (file:line function)
    schedule: str = "default"  # the order the emulator ran the threads in when it was found (emulate())

    def __str__(self) -> str:
        places = [f.split(" ")[0] for f in self.frames]
        template = [p for p in places if ".j2:" in p]
        notes = [f"called from line {p.rpartition(':')[2]}" for p in template[1:3]]
        if places and ".j2:" not in places[0]:
            notes.append(f"in {places[0]}")
        where = f" ({'; '.join(notes)})" if notes else ""
        schedule = f" (schedule {self.schedule})" if self.schedule != "default" else ""
        return (f"{self.kind}: {self.kernel} at {self.location}{where}, block {self.block}, thread {self.thread}"
                f"{schedule}: {self.detail}")


def _template_path(path: str) -> str:
    """A source path as the project names it: templates/..., or the emulator's own header."""
    for marker in ("templates/", "emulation/cuda/"):
        if marker in path:
            return path[path.index(marker):]
    return os.path.basename(path)


_SITE = re.compile(r"\{pc:([0-9a-f]+)\}")


def _site_name(chain: list[str]) -> str:
    """A code address's place as a finding's text names it: its template line (the innermost
    templates/ frame), else the innermost frame."""
    places = [f.split(" ")[0] for f in chain]
    place = next((p for p in places if p.startswith("templates/")), places[0] if places else "?")
    if not place.startswith(("templates/", "emulation/cuda/")) and ".cu:" in place:  # the rendered file itself
        return f"line {place.rpartition(':')[2]} of the kernel's generated source"
    return place


def symbolize(library: Path, offsets: list[int]) -> list[list[str]]:
    """For each code offset in `library`, its inline call chain innermost first ("file:line function")."""
    if not offsets:
        return []
    try:
        r = subprocess.run(["addr2line", "-a", "-f", "-i", "-C", "-e", str(library), *(hex(o) for o in offsets)],
                           capture_output=True, text=True)
    except FileNotFoundError:  # binutils missing: findings keep their kind and detail, without lines
        return [[] for _ in offsets]
    chains: list[list[str]] = []
    lines = r.stdout.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            chains.append([])
            i += 1
            continue
        if i + 1 < len(lines) and chains:
            func, where = lines[i], lines[i + 1]
            file, _, line = where.rpartition(":")
            line = line.split(" ")[0]
            chains[-1].append(f"{_template_path(file)}:{line} {func}")
        i += 2
    return chains + [[] for _ in range(len(offsets) - len(chains))]


class EmulatedFunction:
    """One kernel of a library, called like a cupy RawKernel (synchronously; no stream)."""

    def __init__(self, module: "EmulatedModule", name: str):
        self.module, self.name = module, name
        self._entry = ctypes.cast(getattr(module.lib, f"emu_entry_{name}"), ctypes.c_void_p)

    def __call__(self, grid, block, args, shared_mem: int = 0, names: tuple = ()) -> None:
        """Runs the kernel over `grid` x `block`; args: tensors (None: a null pointer) and each scalar's
        bytes, named by `names` in findings. A launch the emulated GPU would refuse raises LaunchRefused
        (and, sanitizing, is also a finding of kind "launch")."""
        from autoflash.emulation import guards
        from autoflash.emulation.context import active, schedule_code

        lib, sanitize = self.module.lib, self.module.sanitize
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        emulation = active()
        schedule = emulation.schedule if emulation else "default"
        try:
            registers = check_launch(self.name, self.module.config, grid, block, shared_mem,
                                     emulation.profile if emulation else None)
        except LaunchRefused as e:
            if sanitize:
                self.module.add_finding(Finding("launch", self.name, "?", (0, 0, 0), -1, str(e), ()))
            raise
        names = tuple(names) + (None,) * (len(args) - len(names))
        names = tuple(n or f"argument {i}" for i, n in enumerate(names))
        keep, ptrs, sizes = [], (ctypes.c_void_p * len(args))(), (ctypes.c_uint * len(args))()
        guarded, named = [], dict(zip(names, args))
        for i, a in enumerate(args):
            if a is None:  # a null pointer: an argument the call does not have (never read)
                buf = ctypes.c_uint64(0)
                if sanitize:  # named in the finding of an access through it
                    lib.emu_add_region(names[i].encode(), None, None, 0, 1, 0, None, None)
            elif isinstance(a, torch.Tensor):
                buf = ctypes.c_uint64(a.data_ptr())
                if sanitize:
                    self._register(a, names[i], grid, named)
                    if guards.guard_of(a) is not None:
                        guarded.append((names[i], a))
            else:  # a scalar's bytes, or a tensor map's (the emulator's encoding), by value
                mapped = isinstance(a, TiledMap)
                data = (a.emulated() if mapped else np.asarray(a)).tobytes()
                buf = ctypes.create_string_buffer(data, len(data))
                if sanitize and mapped and a.tensor is not None:  # the tensor its TMA copies reach
                    self._register(a.tensor, names[i], grid, named, mapped=True)
                    if guards.guard_of(a.tensor) is not None:
                        guarded.append((names[i], a.tensor))
            keep.append(buf)
            ptrs[i] = ctypes.cast(ctypes.pointer(buf), ctypes.c_void_p)
            sizes[i] = ctypes.sizeof(buf)
        try:
            failed = lib.emu_launch(self._entry, self.name.encode(), *grid, *block, shared_mem, ptrs, sizes, len(args),
                                    os.cpu_count() or 1, registers or 0, *schedule_code(schedule), schedule.encode())
        finally:
            if sanitize:
                lib.emu_clear_regions()
        for name, t in guarded:  # normally the access itself was reported; this sees any that was not
            changed = guards.check_guards(t)  # (and poisons the guards again)
            if changed and not self.module.reported(f" of {name} at element "):
                self.module.add_finding(Finding("out-of-bounds", self.name, "?", (0, 0, 0), -1,
                                                f"{name}: {changed}", ()))
        if failed and not sanitize:
            found = self.module.findings()
            self.module.clear_findings()
            raise EmulationError(f"emulated launch of {self.name} failed: " + "; ".join(map(str, found[:3])))

    def _register(self, a: torch.Tensor, name: str, grid: tuple, named: dict, mapped: bool = False) -> None:
        """Registers tensor argument `a` for the out-of-bounds checks, with the rule of whose rows each
        block may touch where `a` is a launcher's guarded buffer, and which pages where it is a paged
        cache (the pointer, or `mapped`: a TMA map's view of it)."""
        from autoflash.emulation import guards

        lib = self.module.lib
        shape = (ctypes.c_longlong * a.dim())(*a.shape)
        stride = (ctypes.c_longlong * a.dim())(*a.stride())
        storage = a.untyped_storage()
        lib.emu_add_region(name.encode(), ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(storage.data_ptr()),
                           storage.nbytes(), a.element_size(), a.dim(), shape, stride)
        z_dim, y_dim, row_dim, rows = guards.rows_rule(a, grid)
        bounds, bounds_name = [], b""
        if rows is not None:  # packed rows: counted by the cu_seqlens the kernel itself gets
            cu = named.get(f"cu_seqlens_{rows}")
            if isinstance(cu, torch.Tensor) and cu.numel() - 1 >= grid[2]:
                bounds, bounds_name = cu[:grid[2] + 1].tolist(), f"cu_seqlens_{rows}".encode()
        if rows is None or not bounds:
            row_dim = -1
        if (z_dim, y_dim, row_dim) != (-1, -1, -1):
            lib.emu_region_rows(z_dim, y_dim, row_dim, (ctypes.c_longlong * len(bounds))(*bounds), len(bounds),
                                bounds_name)
        table, lengths = named.get("block_table"), named.get("cache_seqlens")
        if name in ("k", "v", "k_cache", "v_cache") and isinstance(table, torch.Tensor) \
                and isinstance(lengths, torch.Tensor) and a.dim() == 4:
            # a paged cache (num_blocks, page_size, heads_kv, d), which a TMA map sees as (num_blocks,
            # heads_kv, page_size, d): block z reads the pages its row names
            page = a.shape[2] if mapped else a.shape[1]
            picked = named.get("cache_batch_idx")  # the block-table row of each sequence, if not its own
            row = picked.tolist() if isinstance(picked, torch.Tensor) else list(range(grid[2]))
            rows = [table[row[z], :-(-int(n) // page)].tolist() for z, n in enumerate(lengths.tolist()[:grid[2]])]
            offsets = [0]
            for r in rows:
                offsets.append(offsets[-1] + len(r))
            flat = [p for r in rows for p in r]
            lib.emu_region_pages(0, (ctypes.c_longlong * max(1, len(flat)))(*flat),
                                 (ctypes.c_longlong * len(offsets))(*offsets), len(rows), b"block_table")


class EmulatedModule:
    """One kernel library (a config's kernels, plain or sanitizing)."""

    def __init__(self, path: Path, sanitize: bool, config: KernelConfig | None = None):
        self.path, self.sanitize, self.config = path, sanitize, config
        self._extra: list[Finding] = []  # found on the Python side: refused launches, changed guard bytes
        self.lib = lib = ctypes.CDLL(str(path))
        lib.emu_launch.restype = ctypes.c_int
        lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, *[ctypes.c_uint] * 6, ctypes.c_ulong,
                                   ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint), ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_char_p]
        lib.emu_add_region.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int,
                                       ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.POINTER(ctypes.c_longlong)]
        lib.emu_region_pages.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_longlong),
                                         ctypes.POINTER(ctypes.c_longlong), ctypes.c_int, ctypes.c_char_p]
        lib.emu_region_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_longlong),
                                        ctypes.c_int, ctypes.c_char_p]
        lib.emu_finding.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]

    def add_finding(self, finding: Finding) -> None:
        self._extra.append(finding)

    def reported(self, text: str) -> bool:
        """Whether a finding of the runtime so far says `text` (its raw detail; no symbolizing)."""
        buf = ctypes.create_string_buffer(1 << 14)
        for i in range(self.lib.emu_finding_count()):
            self.lib.emu_finding(i, buf, len(buf))
            if text in buf.value.decode(errors="replace").split("\t")[4]:
                return True
        return False

    def get_function(self, name: str) -> EmulatedFunction:
        return EmulatedFunction(self, name)

    def findings(self) -> list[Finding]:
        raw = []
        buf = ctypes.create_string_buffer(1 << 14)
        for i in range(self.lib.emu_finding_count()):
            self.lib.emu_finding(i, buf, len(buf))
            kind, kernel, block, thread, detail, schedule, pcs = buf.value.decode(errors="replace").split("\t")
            raw.append((kind, kernel, tuple(int(x) for x in block.split(",")), int(thread), detail, schedule,
                        [int(p, 16) for p in pcs.split(",") if p]))
        # a detail may name another place in the kernel as {pc:HEX} (the other access of a race)
        sites = sorted({int(h, 16) for *_, detail, _, _ in raw for h in _SITE.findall(detail)})
        chains = symbolize(self.path, [p for *_, pcs in raw for p in pcs] + sites)
        site_names = {pc: _site_name(chain) for pc, chain in zip(sites, chains[len(chains) - len(sites):])}
        out, at = [], 0
        for kind, kernel, block, thread, detail, schedule, pcs in raw:
            detail = _SITE.sub(lambda m: site_names.get(int(m.group(1), 16), "?"), detail)
            frames = [f for chain in chains[at:at + len(pcs)] for f in chain]
            at += len(pcs)
            # The kernel's own frames: drop the runtime's (and anything below the kernel's entry).
            frames = [f for f in frames if f.startswith("templates/")]
            kernel_frames = []
            for f in frames:
                if f not in kernel_frames:
                    kernel_frames.append(f)
            location = next((f.split(" ")[0] for f in kernel_frames if ".j2:" in f),
                            kernel_frames[0].split(" ")[0] if kernel_frames else "?")
            out.append(Finding(kind, kernel, location, block, thread, detail, tuple(kernel_frames), schedule))
        return out + self._extra

    def clear_findings(self) -> None:
        self.lib.emu_clear_findings()
        self._extra.clear()


_MODULES: dict[tuple[KernelConfig, bool], EmulatedModule] = {}


def load_module(config: KernelConfig, sanitize: bool) -> EmulatedModule:
    """The library of a config's kernels, built (disk-cached) and loaded once per process."""
    key = (config, sanitize)
    if key not in _MODULES:
        _MODULES[key] = EmulatedModule(build_library(render(config), config.name, config.symbols, sanitize), sanitize,
                                       config)
    return _MODULES[key]


@functools.lru_cache(maxsize=None)
def load_functions(config: KernelConfig, sanitize: bool = False) -> dict:
    """{symbol: EmulatedFunction} of a config's kernels (the emulator's load_functions)."""
    module = load_module(config, sanitize)
    return {name: module.get_function(name) for name in config.symbols}


def loaded_modules() -> list[tuple[tuple[KernelConfig, bool], EmulatedModule]]:
    """Every kernel library loaded in this process, by (config, sanitize)."""
    return list(_MODULES.items())
