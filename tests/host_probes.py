"""The probe kernels of tests/host/*.cu.j2 (templates that test one emulator feature) rendered with
the project's templates on the include path and built for the host emulator, once per source (the
build is cached on disk by its hash)."""
import hashlib
from pathlib import Path

import jinja2

from autoflash.emulation import build
from autoflash.emulation.module import EmulatedModule
from autoflash.kernels.resources import templates_dir

HOST = Path(__file__).parent / "host"


def render(template: str, **params) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(templates_dir()), str(HOST)]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template(template).render(**params)


def load(source: str, stem: str, entries: tuple[str, ...], sanitize: bool) -> EmulatedModule:
    """The emulated module of a rendered probe, its library named `stem` and the source's hash."""
    key = hashlib.sha256(source.encode()).hexdigest()[:12]
    return EmulatedModule(build.build_library(source, f"{stem}_{key}", entries, sanitize), sanitize)
