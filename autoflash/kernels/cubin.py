"""What a cubin tells the driver about a kernel, read from the ELF directly (no CUDA tool, no GPU):
- its parameters: the `.nv.info.<kernel>` section's EIATTR_KPARAM_INFO records (ordinal, offset and
  size of each parameter, as `cuobjdump -elf` prints them) and EIATTR_CBANK_PARAM_SIZE (the bytes the
  driver copies into the parameter bank), compared with what the host packs (kernels/launch.py
  KernelParams);
- its resources: the `.nv.info` section's EIATTR_REGCOUNT and EIATTR_FRAME_SIZE records for the
  kernel's symbol and the size of its `.nv.shared.<kernel>` section, what `ptxas -v` reports as
  registers, stack frame and (less the 1 KB the driver reserves from sm_90 on) shared memory."""
from __future__ import annotations

import dataclasses
import struct

# .nv.info attribute records: a format byte, an attribute byte, then for EIFMT_SVAL a 16-bit size and
# that many bytes, for the other formats a 16-bit value.
EIFMT_SVAL = 0x04
EIATTR_FRAME_SIZE = 0x11
EIATTR_KPARAM_INFO = 0x17
EIATTR_CBANK_PARAM_SIZE = 0x19
EIATTR_REGCOUNT = 0x2F


@dataclasses.dataclass(frozen=True)
class Param:
    ordinal: int  # the parameter's position in the kernel's signature
    offset: int  # bytes from the start of the parameter bank
    size: int  # bytes


@dataclasses.dataclass(frozen=True)
class ParamTable:
    params: tuple[Param, ...]  # by ordinal
    bank_bytes: int  # EIATTR_CBANK_PARAM_SIZE

    @property
    def relative(self) -> tuple[tuple[int, int], ...]:
        """(offset, size) of each parameter from the first one's offset: sm_90 kernels whose first
        parameter is 64-byte aligned (a TMA map) start it past a pad that keeps the bank address
        aligned; the layout after it is the C ABI's, as a packed host buffer's."""
        base = self.params[0].offset if self.params else 0
        return tuple((p.offset - base, p.size) for p in self.params)


def _headers(elf: bytes) -> dict[str, tuple]:
    """Section name -> its header (name, type, flags, addr, offset, size, link, info, align, entsize)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError(f"cubin: got {elf[:5]!r}..., expected a 64-bit ELF")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    strtab = headers[names][4]

    def name(offset: int) -> str:
        start = strtab + offset
        return elf[start:elf.index(b"\0", start)].decode()

    return {name(h[0]): h for h in headers}


def _sections(elf: bytes) -> dict[str, bytes]:
    return {name: elf[h[4]:h[4] + h[5]] for name, h in _headers(elf).items()}


def _records(info: bytes):
    """The (attribute, value) records of a .nv.info section: value bytes for EIFMT_SVAL, else an int."""
    i = 0
    while i + 4 <= len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == EIFMT_SVAL:
            size, = struct.unpack_from("<H", info, i + 2)
            yield attr, info[i + 4:i + 4 + size]
            i += 4 + size
        else:
            yield attr, struct.unpack_from("<H", info, i + 2)[0]
            i += 4


@dataclasses.dataclass(frozen=True)
class Usage:
    registers: int  # EIATTR_REGCOUNT
    frame_bytes: int  # EIATTR_FRAME_SIZE: ptxas's "bytes stack frame"
    shared_section_bytes: int  # .nv.shared.<kernel>: static shared memory and, from sm_90 on, the 1 KB reserved


def usage(cubin: bytes, kernel: str) -> Usage:
    """The resources the cubin records for entry `kernel`; ValueError when it has no such kernel."""
    headers = _headers(cubin)
    text = headers.get(f".text.{kernel}")
    if text is None:
        raise ValueError(f"cubin: no .text section for kernel {kernel!r}")
    symbol = text[7] & 0xFFFFFF  # the section's sh_info: the kernel's symbol (the register count above it, on old cubins)
    found = {}
    for attr, value in _records(_sections(cubin).get(".nv.info", b"")):
        if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and isinstance(value, bytes) and len(value) == 8:
            owner, number = struct.unpack("<II", value)
            if owner == symbol:
                found[attr] = number
    if EIATTR_REGCOUNT not in found:
        raise ValueError(f"cubin: no EIATTR_REGCOUNT record for kernel {kernel!r}")
    shared = headers.get(f".nv.shared.{kernel}")
    return Usage(found[EIATTR_REGCOUNT], found.get(EIATTR_FRAME_SIZE, 0), shared[5] if shared else 0)


def param_table(cubin: bytes, kernel: str) -> ParamTable:
    """The parameter table of entry `kernel` in `cubin`; ValueError when the cubin has no such kernel."""
    info = _sections(cubin).get(f".nv.info.{kernel}")
    if info is None:
        raise ValueError(f"cubin: no .nv.info section for kernel {kernel!r}")
    params, bank = [], None
    for attr, value in _records(info):
        if attr == EIATTR_KPARAM_INFO:
            _index, ordinal, offset, flags = struct.unpack("<IHHI", value)
            params.append(Param(ordinal, offset, flags >> 18))  # size: the word's top 14 bits
        elif attr == EIATTR_CBANK_PARAM_SIZE:
            bank = value
    if bank is None:
        raise ValueError(f"cubin: kernel {kernel!r} has no EIATTR_CBANK_PARAM_SIZE")
    return ParamTable(tuple(sorted(params, key=lambda p: p.ordinal)), bank)
