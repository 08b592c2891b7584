"""From a KernelConfig to a launched kernel: the config and its shared-memory model, GPU profiles and
built-in defaults, Jinja2 rendering, NVRTC compilation, input checks, the launcher and its autograd
Function."""
