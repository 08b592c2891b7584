"""Renders a KernelConfig into CUDA source from the Jinja2 templates. The output carries `#line`
directives so that compiler messages point at the template line that produced the code."""
from __future__ import annotations

import functools
import hashlib
import re

import jinja2

from autoflash import __version__
from autoflash.kernels.config import KernelConfig
from autoflash.kernels.resources import templates_dir

TEMPLATES = {("fwd", "sm80"): "flash_fwd.cu.j2", ("bwd", "sm80"): "flash_bwd.cu.j2",
             ("fwd", "sm90"): "flash_fwd_sm90.cu.j2", ("bwd", "sm90"): "flash_bwd_sm90.cu.j2"}
# Per-dtype spellings the templates need; fp32 runs on the SIMT path and needs no mma.
_DTYPE_CODE = {
    "fp16": {"elem_type": "__half", "mma": "mma_16816_f16", "pack": "pack_f16x2", "ptype": "f16"},
    "bf16": {"elem_type": "__nv_bfloat16", "mma": "mma_16816_bf16", "pack": "pack_bf16x2", "ptype": "bf16"},
    "fp32": {"elem_type": "float", "mma": None, "pack": None, "ptype": None},
}
_MARK = "\x1e{}|{}\x1f"  # invisible (template, line) marker, appended to template lines before rendering
_MARK_RE = re.compile("\x1e([^|\x1f]+)\\|(\\d+)\x1f")
_TAG_RE = re.compile(r"\{%|%\}|\{#|#\}")


def _mark_lines(source: str, name: str) -> str:
    """Tags each template line that holds no Jinja statement with its template and line number."""
    out = []
    for n, line in enumerate(source.split("\n"), start=1):
        out.append(line if _TAG_RE.search(line) else line + _MARK.format(name, n))
    return "\n".join(out)


def _resolve_lines(rendered: str, directives: bool) -> str:
    """Replaces the markers by `#line` directives wherever the template-to-output mapping jumps
    (within a template, or into one it includes)."""
    out: list[str] = []
    expected = None  # (template, line) the next output line maps to without a directive
    for i, line in enumerate(rendered.split("\n")):
        marks = _MARK_RE.findall(line)
        line = _MARK_RE.sub("", line)
        if marks and directives:
            name, n = marks[-1][0], int(marks[-1][1])
            # Line 1 is the kernel's title; the mapping starts right below it.
            if i > 0 and (name, n) != expected:
                out.append(f'#line {n} "templates/{name}"')
            expected = (name, n + 1)
        elif expected is not None:
            expected = (expected[0], expected[1] + 1)
        out.append(line)
    return "\n".join(out)


class _MarkingLoader(jinja2.FileSystemLoader):
    def get_source(self, environment, template):
        source, path, uptodate = super().get_source(environment, template)
        return _mark_lines(source, template), path, uptodate


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=_MarkingLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(config: KernelConfig, *, line_directives: bool = True) -> str:
    """CUDA source of the kernel `config.name` (extern "C", so the symbol is the name)."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"render: got {type(config).__name__}, expected a KernelConfig")
    template_name = TEMPLATES[config.direction, config.family]
    template = _environment().get_template(template_name)
    text = template.render(cfg=config, version=__version__, **_DTYPE_CODE[config.dtype])
    return _resolve_lines(text, line_directives)


@functools.lru_cache(maxsize=1)
def template_hash() -> str:
    """Hash of every template and helper header: part of cache keys and tuned-table provenance."""
    h = hashlib.sha256()
    root = templates_dir()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".j2", ".cuh")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]
